"""The budget holds in real training: ``prepare(model, result)`` on batches made fresh each
step, as a DataLoader makes them (the next one made while the last is still held), with
every byte the process allocates counted, for many steps."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import autotune
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.models import gpt_batch, tiny_gpt

MIB = 2**20


class ConvNet(nn.Module):
    """A small image classifier: its input batch is a large share of its memory."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
                for c in (3, 16, 16)
            ]
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(x).mean(dim=(2, 3)))
        return nn.functional.cross_entropy(logits, y)


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=64,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=128,
        num_labels=10,
    )
    return ViTForImageClassification(config)


def vit_batch(model: nn.Module, n: int, seed: int) -> dict[str, torch.Tensor]:
    x, y = images(n, seed)
    return {"pixel_values": x, "labels": y}


CASES = {
    "gpt": (
        lambda: tiny_gpt(n_layer=3, n_embd=64, n_head=2, block_size=64, vocab_size=128),
        lambda model, n, seed: gpt_batch(model.config, n, seed=seed),
        4.0 * MIB,
    ),
    "convnet": (ConvNet, lambda model, n, seed: images(n, seed), 12.0 * MIB),
    # Its images are large beside its activations: at a tight budget, small micro-batches
    # and checkpointing, the two batches a loader holds between steps are the peak.
    "vit": (vit, vit_batch, 4.8 * MIB),
}
STEPS = 30


@pytest.mark.parametrize("case", ["convnet"])
def test_training_on_fresh_batches_stays_within_the_budget(case: str) -> None:
    """The convnet, whose input batch is a large share of its memory; the GPT and the ViT
    (5 minutes more on a 2-core VM): ``python benchmarks/fresh_batches.py``."""
    build, make_batch, budget = CASES[case]
    torch.manual_seed(0)
    model = build()
    sample = make_batch(model, 4, 0)
    result = autotune.autotune(
        model, sample, budget / 2**30, global_batch_size=32, device="cpu", n_trials=16
    )
    assert abs(result.predicted.peak_bytes - result.measured.peak_bytes) <= 0.03 * (
        result.measured.peak_bytes
    )
    work = copy.deepcopy(model)

    def loader(steps: int = STEPS) -> Iterator[Any]:
        for step in range(steps):
            yield make_batch(model, 32, step + 1)

    with autotune.prepare(work, result, device="cpu", lr=1e-3) as runner:
        tracker = LiveBytesTracker("cpu")
        tracker.track(state_tensors(runner.model))
        with tracker:  # sees the batches being made, as they are in a training loop
            for batch in loader():
                runner.step(batch)
        # The public reading a user takes of their own loop: the same figure.
        with autotune.peak_memory(runner) as reading:
            for batch in loader(5):
                runner.step(batch)
    # What training really held is what verification measured (so within the budget).
    assert tracker.peak <= result.measured.peak_bytes * 1.01, (tracker.peak, result.measured)
    assert tracker.peak <= result.budget_bytes
    assert reading.peak_bytes == pytest.approx(tracker.peak, rel=1e-3)
    assert reading.peak_bytes <= result.budget_bytes
