"""Wrapping blocks: checkpointed ones recompute their activations in backward, offloaded
ones send them to the host. A block's ``forward`` is replaced on the instance and put
back by :func:`remove_checkpointing`, which leaves the model as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from autotune.config import TrainConfig
from autotune.errors import BlockError
from autotune.train._offload_activations import ActivationOffloader

__all__ = ["apply_checkpointing", "apply_offloading", "check_blocks", "remove_checkpointing"]

_ORIGINAL = "_autotune_original_forward"


def apply_checkpointing(model: nn.Module, names: Sequence[str]) -> None:
    """Recompute the activations of the named blocks in backward (non-reentrant checkpoint).

    Raises:
        BlockError: a name is not a submodule of ``model``; then no block is wrapped.
    """
    for module in _resolve(model, names, "checkpoints"):
        _wrap(module, functools.partial(_checkpointed_forward, module.forward))


def apply_offloading(
    model: nn.Module, names: Sequence[str], offloader: ActivationOffloader
) -> None:
    """Send the saved activations of the named blocks to host memory (see ``_offload``).

    Raises:
        BlockError: a name is not a submodule of ``model``; then no block is wrapped.
    """
    for name, module in zip(names, _resolve(model, names, "offloads"), strict=True):
        _wrap(module, functools.partial(offloader.forward, name, module.forward))


def check_blocks(model: nn.Module, config: TrainConfig) -> None:
    """Raise :class:`BlockError` if ``config`` names a block ``model`` does not have."""
    _resolve(model, config.checkpoint, "checkpoints")
    _resolve(model, config.offload_activations, "offloads")


def _resolve(model: nn.Module, names: Sequence[str], verb: str) -> list[nn.Module]:
    modules = []
    for name in names:  # resolve every name first, so that an error leaves the model as it was
        try:
            modules.append(model.get_submodule(name))
        except AttributeError:
            raise BlockError(
                f"the config {verb} block {name!r}, which this model does not have; "
                "was the config tuned for another model?"
            ) from None
    return modules


def _wrap(module: nn.Module, forward: Any) -> None:
    if _ORIGINAL in module.__dict__:
        return
    module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
    module.forward = forward


def remove_checkpointing(model: nn.Module) -> None:
    """Undo :func:`apply_checkpointing` and :func:`apply_offloading` on every block."""
    for module in model.modules():
        if _ORIGINAL not in module.__dict__:
            continue
        previous = module.__dict__.pop(_ORIGINAL)
        if previous is None:
            del module.forward
        else:
            module.forward = previous


# Keyword arguments through which Hugging Face layers read and write a key/value cache.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    # A cache written in the forward would be read (or written again) by the recompute,
    # which then differs from the original; Hugging Face drops it for checkpointed layers.
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    return _checkpoint(forward, *args, use_reentrant=False, **kwargs)
