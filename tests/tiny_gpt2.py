"""The small Hugging Face GPT-2 the trainers' tests and the compiled-model tests share:
one model and micro-batch, so that inductor compiles its graphs once for all of them (its
cache is on disk)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

__all__ = ["MICRO", "SEQ", "VOCAB", "gpt2"]

MICRO = 4
SEQ = 32
VOCAB = 128


def gpt2() -> nn.Module:
    """A 4-layer GPT-2 without dropout (the trainers draw random numbers of their own)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    # The Trainer would normalise the loss by the tokens of the whole accumulated batch;
    # autotune weights micro-batch means by samples (equal here, but not bit for bit).
    model.accepts_loss_kwargs = False
    return model
