"""Wrapping blocks: checkpointed ones recompute their activations in backward, offloaded
ones send them to the host. A block's ``forward`` is replaced on the instance and put
back by :func:`remove_checkpointing`, which leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint as _checkpoint

from autotune.config import TrainConfig
from autotune.errors import BlockError
from autotune.train._offload_activations import ActivationOffloader

__all__ = [
    "apply_checkpointing",
    "apply_offloading",
    "check_blocks",
    "recompute_error",
    "remove_checkpointing",
]

_ORIGINAL = "_autotune_original_forward"


def apply_checkpointing(model: nn.Module, names: Sequence[str]) -> None:
    """Recompute the activations of the named blocks in backward (non-reentrant checkpoint).

    Raises:
        BlockError: a name is not a submodule of ``model``; then no block is wrapped.
    """
    for name, module in zip(names, _resolve(model, names, "checkpoints"), strict=True):
        _wrap(module, functools.partial(_checkpointed_forward, name, module, module.forward))


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


# Keyword arguments through which Hugging Face layers read and write a key/value cache
# (transformers 5 renamed ``past_key_values`` to ``cache``).
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")

_last_recomputed: list[str] = [""]
"""The block recomputed last: the one a CheckpointError raised in backward is about."""


def recompute_error(exc: Exception) -> BlockError:
    """The error to raise for a ``CheckpointError`` from backward: the block recomputed
    last saved other tensors than its forward did."""
    lines = str(exc).removeprefix("torch.utils.checkpoint: ").splitlines()
    detail = " ".join(line.strip() for line in lines[:3] if line.strip())
    return BlockError(
        f"block {_last_recomputed[0]!r} cannot be checkpointed: recomputed in backward, it "
        f"saved other tensors than its forward did ({detail}). Its "
        "forward depends on state it changes (a cache, a counter, a random choice outside "
        "torch's generator). Tune without checkpointing it: name the blocks that can be "
        "with SearchSpace(blocks=[...]), or SearchSpace(checkpointing=False)."
    )


def _checkpointed_forward(
    name: str, module: nn.Module, forward: Any, *args: Any, **kwargs: Any
) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    # A cache written in the forward would be read (or written again) by the recompute,
    # which then differs from the original; Hugging Face drops it for checkpointed layers
    # unless the layer only reads it (``_can_checkpoint_with_cache``).
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
    changed: list[nn.Module] = []
    calls = 0

    def run(*a: Any, **k: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:  # the recomputation in backward: it must leave the buffers alone
            _last_recomputed[0] = name
            with _buffers_kept(changed):
                return forward(*a, **k)
        before = _buffer_versions(module)
        out = forward(*a, **k)
        changed.extend(_changed_owners(module, before))
        return out

    return _checkpoint(run, *args, use_reentrant=False, **kwargs)


def _buffer_versions(module: nn.Module) -> dict[int, int]:
    """The in-place version counter of each buffer of ``module``, by the buffer's id."""
    return {id(b): b._version for b in module.buffers()}


def _changed_owners(module: nn.Module, before: dict[int, int]) -> list[nn.Module]:
    """The submodules of ``module`` whose forward changed their buffers in place.

    A kernel may update a buffer without bumping its version (BatchNorm's running
    statistics), so a module counts as a whole: one changed buffer (BatchNorm's
    ``num_batches_tracked``) marks all of its buffers. Norm layers tracking statistics in
    training mode count even where no counter moved (``momentum`` set, no counter).
    """
    return [
        owner
        for owner in module.modules()
        if any(before.get(id(b)) != b._version for b in owner._buffers.values() if b is not None)
        or (isinstance(owner, _NormBase) and owner.training and owner.track_running_stats)
    ]


@contextlib.contextmanager
def _buffers_kept(owners: Sequence[nn.Module]) -> Iterator[None]:
    """Run the recomputation on copies of the buffers its forward changed in place.

    A block's forward may update state as it runs: BatchNorm's running statistics and
    ``num_batches_tracked`` in training mode. Recomputed, it would update them a second
    time, and the model would evaluate differently from one trained without
    checkpointing. The recomputation gets copies (which its saved tensors may keep for
    backward); the originals hold what the forward wrote, once.
    """
    kept = [(owner, dict(owner._buffers)) for owner in owners]
    for owner, buffers in kept:
        for key, buffer in buffers.items():
            if buffer is not None:
                owner._buffers[key] = buffer.clone()
    try:
        yield
    finally:
        for owner, buffers in kept:
            owner._buffers.update(buffers)
