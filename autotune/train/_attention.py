"""The attention implementation of a Hugging Face model, set for training and put back.

Hugging Face models dispatch attention through ``config._attn_implementation`` at every
forward (``eager``, ``sdpa``, ``flash_attention_2``, ...), and ``set_attn_implementation``
changes it on a built model, checking that the implementation is installed. The
implementations compute the same attention (within the dtype's tolerance) with different
memory (eager keeps the attention matrix for backward) and speed: a knob the tuner
measures like any other.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from autotune.errors import ConfigError

__all__ = ["attention_of", "set_attention"]


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation ``model`` runs; ``None``: it has no such choice."""
    value = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return value if isinstance(value, str) else None


def set_attention(model: nn.Module, name: str) -> Callable[[], None]:
    """Make ``model`` run attention implementation ``name``; returns what puts it back.

    Raises:
        ConfigError: the model has no attention implementation to choose, cannot change it
            once built, or ``name`` is not installed.
    """
    before = attention_of(model)
    setter = getattr(model, "set_attn_implementation", None)
    if before is None or not callable(setter):
        raise ConfigError(
            f"attention {name} asked for, but {type(model).__name__} has no attention "
            "implementation to choose (a Hugging Face model's attn_implementation); leave "
            "attention unset."
        )
    if name != before:
        try:
            setter(name)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"attention {name} is not available here: {str(exc).splitlines()[0][:200]}"
            ) from None
        if attention_of(model) != name:
            setter(before)
            raise ConfigError(
                f"{type(model).__name__} cannot change its attention implementation once "
                f"built; load it with attn_implementation={name!r} instead."
            )

    def put_back() -> None:
        if attention_of(model) != before:
            setter(before)

    return put_back
