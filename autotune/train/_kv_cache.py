"""Training needs no key/value cache: every Hugging Face config in a model turned off.

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

__all__ = ["disable_kv_cache"]


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
