"""The built-in GPT, the first model a user sees: it starts as a fresh model should."""

from __future__ import annotations

import math

import torch

from autotune.models import example_batch, gpt_batch, tiny_gpt


def test_a_fresh_gpt_predicts_near_uniformly() -> None:
    model = tiny_gpt()
    x, y = example_batch()
    with torch.no_grad():
        loss = float(model(x, y))
    assert abs(loss - math.log(model.config.vocab_size)) < 0.3, loss


def test_it_learns_a_batch_it_sees_again() -> None:
    model = tiny_gpt(n_layer=2, n_embd=64, vocab_size=64, block_size=16)
    x, y = gpt_batch(model.config, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(x, y).item()
    for _ in range(30):
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    assert model(x, y).item() < 0.5 * first
