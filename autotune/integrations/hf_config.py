"""A Hugging Face causal language model from its config file alone, to plan without weights.

``causal_lm("config.json", seq_len=4096)`` gives what :func:`autotune.plan_ahead` takes:
a factory of the model (``AutoModelForCausalLM.from_config``: the architecture, no
weights read or downloaded; fp32 weights, which autotune's precisions train, bf16 and fp16
by autocast) and one of a sample batch of token ids at that length. Both
are called under tracing, so neither holds memory (``autotune[hf]``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.errors import ConfigError

__all__ = ["REQUIRED", "causal_lm"]

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
    _check_sizes(path, seq_len)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers' own validation errors are of many classes
        first = " ".join(str(exc).split())[:300]
        raise ConfigError(f"transformers cannot read {str(path)!r}: {first}") from None
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


_SIZES = {
    "num_hidden_layers": 1024,
    "hidden_size": 65536,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "vocab_size": 1 << 22,
}
"""The sizes a causal LM's config must give, and the most any model has (the largest
published ones are within a tenth of these): beyond them, a typo or hostile input that
would take hours to trace."""
_MOST_TOKENS = 1 << 21
"""The longest sequence planned (2M tokens): tracing makes Hugging Face's attention mask
for real, and its rows grow with the square of it."""
REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size")
"""The sizes a config must state itself: else transformers' defaults (a 7B) are planned."""


def _check_sizes(path: Path, seq_len: int) -> None:
    """Each size of the config file (its text model's, for a multimodal one) stated, a
    positive integer and not absurd, and ``seq_len`` within its positions.

    Raises:
        ConfigError: naming the field, its value and what it may be.
    """
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{str(file)!r} is not a JSON config: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{str(file)!r} holds no config object.")
    nested = raw.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else raw
    missing = [k for k in REQUIRED if k not in text and k not in raw]
    if missing:
        raise ConfigError(
            f"{str(file)!r} does not state {', '.join(missing)}: transformers would plan its "
            "defaults for them; pass the model's own config.json."
        )
    for key, most in _SIZES.items():
        value = text.get(key, raw.get(key))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ConfigError(
                f"{str(file)!r}: {key} is {str(value)[:40]}; it must be a whole number from 1 "
                f"to {most:,}."
            )
    if seq_len > _MOST_TOKENS:  # a real mask of this length is made while tracing
        raise ConfigError(f"--seq-len {seq_len:,} is past {_MOST_TOKENS:,} tokens; plan fewer.")
    positions = text.get("max_position_embeddings", raw.get("max_position_embeddings"))
    if isinstance(positions, int) and not isinstance(positions, bool) and seq_len > positions:
        raise ConfigError(
            f"--seq-len {seq_len} is past the model's max_position_embeddings, {positions}: "
            f"plan at most {positions} tokens, or a config with more positions."
        )


def _vocab_size(config: Any) -> int:
    """The vocabulary size of a config, or of its text model's (multimodal configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"the config of {config.model_type} has no vocab_size to sample from.")
    return vocab
