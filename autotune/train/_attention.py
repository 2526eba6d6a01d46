"""The attention implementation of a Hugging Face model, set for training and put back.

Hugging Face models dispatch attention through ``config._attn_implementation`` at every
forward (``eager``, ``sdpa``, ``flash_attention_2``, ...), and ``set_attn_implementation``
changes it on a built model, checking that the implementation is installed. The
implementations compute the same attention (within the dtype's tolerance) with different
memory (eager keeps the attention matrix for backward) and speed: a knob the tuner
measures like any other.

Training needs no key/value cache: every Hugging Face config in a model turned off.

Hugging Face models build a cache by default (``config.use_cache``). It holds memory
through the step, and a checkpointed layer's recomputation appends to it again, so its
forward and recomputation save different tensors. Hugging Face's own gradient
checkpointing turns it off; so does autotune, in every config the model holds: an
encoder-decoder's stacks keep their own copies (T5's decoder), a wrapper
(``EncoderDecoderModel``, peft) holds its parts' configs, and a composite config holds
sub-configs (``text_config``, ``decoder``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

from autotune.errors import ConfigError

__all__ = ["attention_of", "disable_kv_cache", "set_attention"]


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


def disable_kv_cache(model: nn.Module) -> Callable[[], None]:
    """Set ``use_cache = False`` in every config of ``model`` that has it on.

    Returns:
        A function that turns each of them back on.
    """
    changed = [config for config in _configs(model) if getattr(config, "use_cache", False)]
    for config in changed:
        setattr(config, "use_cache", False)  # noqa: B010 (a config of any class)

    def undo() -> None:
        for config in changed:
            setattr(config, "use_cache", True)  # noqa: B010

    return undo


def _configs(model: nn.Module) -> Iterator[object]:
    """Every config object held by a module of ``model`` (``module.config``) and, inside
    those, every nested config, each once."""
    seen: set[int] = set()
    stack = [c for m in model.modules() if _is_config(c := getattr(m, "config", None))]
    while stack:
        config = stack.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        if hasattr(config, "use_cache"):  # a composite (Llava's) may not, its text part does
            yield config
        stack.extend(v for v in vars(config).values() if _is_config(v))


def _is_config(value: object) -> bool:
    """A Hugging Face config: it serialises itself, and has a cache or sub-configs."""
    parts = hasattr(value, "use_cache") or hasattr(value, "sub_configs")
    return parts and callable(getattr(value, "to_dict", None))
