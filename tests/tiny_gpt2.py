"""The small Hugging Face GPT-2 the trainers' tests and the compiled-model tests share:
one model and micro-batch, so that inductor compiles its graphs once for all of them (its
cache is on disk); and the padded rows of very different lengths, with a causal language
model for them, that the tests of token-weighted accumulation share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

__all__ = ["MICRO", "SEQ", "VOCAB", "causal_lm", "gpt2", "padded_rows"]

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
    # The Trainer would divide GPT-2's summed loss by all the step's labels, each row's
    # first included, which the loss never counts; off, it takes the model's own mean.
    model.accepts_loss_kwargs = False
    return model


def causal_lm(kind: str = "gpt2") -> nn.Module:
    """A 2-layer causal language model of 64 words without dropout, its key/value cache
    off as in training: Hugging Face's GPT-2 (``"gpt2"``) or Llama (``"llama"``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        config.use_cache = False
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    config.use_cache = False  # a packed row's sequences then see only their own
    return transformers.GPT2LMHeadModel(config)


def padded_rows() -> dict[str, torch.Tensor]:
    """8 rows of words under 64 padded to 32 tokens, of 3 to 32 label tokens each: a
    mean over micro-batches weighed by rows would count the short rows' tokens more than
    one batch does."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (8, 32), generator=g)
    positions = torch.arange(32)
    lengths = torch.tensor([3, 32, 7, 20, 5, 28, 12, 9]).unsqueeze(1)
    mask = (positions < lengths).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
