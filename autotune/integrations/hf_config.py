"""A Hugging Face causal language model from its config file alone, to plan without weights.

``causal_lm("config.json", seq_len=4096)`` gives what :func:`autotune.plan_ahead` takes:
a factory of the model (``AutoModelForCausalLM.from_config``: the architecture, no
weights read or downloaded; fp32 weights, which autotune's precisions train, bf16 and fp16
by autocast) and one of a sample batch of token ids at that length. Both
are called under tracing, so neither holds memory (``autotune[hf]``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.errors import ConfigError

__all__ = ["causal_lm"]

SAMPLE_ROWS = 8
"""Sequences in the sample batch (micro-batches of other sizes repeat or cut its rows)."""


def causal_lm(
    config_path: str | Path, seq_len: int, rows: int = SAMPLE_ROWS
) -> tuple[Callable[[], nn.Module], Callable[[], dict[str, torch.Tensor]]]:
    """(a factory of the model ``config_path`` describes, a factory of a sample batch of
    ``rows`` sequences of ``seq_len`` tokens with their labels).

    Args:
        config_path: A ``config.json`` file, or a folder holding one (read locally only).
        seq_len: Tokens per sequence.
        rows: Sequences in the sample batch.

    Raises:
        ConfigError: no such file, a config transformers cannot read, or one with no causal
            language model.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise ConfigError("--hf-config needs transformers: pip install 'autotune[hf]'.") from exc
    path = Path(config_path)
    if not path.exists():
        raise ConfigError(f"no Hugging Face config at {str(path)!r}; pass a config.json file.")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"the sequence length must be a positive integer, got {seq_len!r}.")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"transformers cannot read {str(path)!r}: {exc}") from exc
    vocab = _vocab_size(config)

    def build() -> nn.Module:
        try:
            model: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
            # fp32 weights, whatever dtype the config was saved in: autotune's precisions
            # train fp32 weights, bf16 and fp16 by autocast (mixed precision)
            return model.to(torch.float32)
        except ValueError as exc:  # a config of no causal LM (an encoder, a vision model)
            raise ConfigError(f"{config.model_type} has no causal language model: {exc}") from exc

    def sample() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (rows, seq_len))
        return {"input_ids": ids, "labels": ids}

    return build, sample


def _vocab_size(config: Any) -> int:
    """The vocabulary size of a config, or of its text model's (multimodal configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"the config of {config.model_type} has no vocab_size to sample from.")
    return vocab
