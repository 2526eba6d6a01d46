"""Wrapping blocks: checkpointed ones recompute their activations in backward (selectively
checkpointed ones only their cheap ops: :mod:`~autotune.train._checkpoint`), offloaded ones
send them to the host. A block's ``forward`` is replaced on the instance and put
back by :func:`remove_checkpointing`, which leaves the model as it was.

A Hugging Face model's own gradient checkpointing, off while autotune's mask applies.

``gradient_checkpointing_enable()`` (which peft's ``prepare_model_for_kbit_training``
calls by default, so every QLoRA model has it on) sets ``gradient_checkpointing`` on each
layer (on the decoder stack before transformers 4.48): every layer then recomputes its
activations whatever the config's mask says, so kept blocks would not be kept and
checkpointed ones would recompute twice over. The tuned mask is what must run.

Selective activation checkpointing: which ops a selectively checkpointed block keeps.

A checkpointed block keeps only its input and recomputes its whole forward in backward.
A selectively checkpointed one (torch's ``create_selective_checkpoint_contexts``, the
op-level policy torchtitan uses) keeps the outputs of its expensive ops, the matrix
products, convolutions and attention kernels, and recomputes only the cheap ones between
them (norms, activations, dropout, casts, elementwise arithmetic). Its memory lies
between keeping the block and checkpointing it; its recomputation costs a fraction of a
forward. The profile measures both, like every other choice of a block.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from torch.utils.checkpoint import checkpoint as _checkpoint

from autotune._spelling import option
from autotune.config import TrainConfig
from autotune.errors import BlockError
from autotune.train._fallback import tracks_statistics
from autotune.train._offload_activations import ActivationOffloader

__all__ = [
    "COMPILED",
    "MODEL_FORWARD",
    "SAVED_OPS",
    "apply_checkpointing",
    "apply_offloading",
    "check_blocks",
    "disable_hf_checkpointing",
    "is_wrapped",
    "named_recompute_errors",
    "remove_checkpointing",
    "replace_forward",
    "restore_forwards",
    "selective_contexts",
]

_ORIGINAL = "_autotune_original_forward"
COMPILED = "_autotune_eager_forward"
"""Where a compiled block keeps its eager ``forward`` (see :mod:`autotune.train._compiled`)."""
MODEL_FORWARD = "_autotune_model_forward"
"""Where a model keeps its own ``forward`` while a loop of one's own trains it with another
(compiled whole, returning the chunked loss; see :class:`~autotune.train._applied.Applied`)."""


def apply_checkpointing(
    model: nn.Module, names: Sequence[str], *, selective: bool = False, plain: bool = False
) -> None:
    """Recompute the activations of the named blocks in backward (non-reentrant checkpoint);
    ``selective``: only those of their cheap ops, the expensive ops' outputs kept.

    ``plain``: torch's checkpoint and nothing around it, which dynamo traces into the graph
    of a model compiled whole: no copies of the buffers a forward changes (a block that
    updates running statistics is refused) and no block named when a recomputation
    differs.

    Raises:
        BlockError: a name is not a submodule of ``model``, (``selective``) a block's
            forward is compiled, or (``plain``) a block updates running statistics: then
            no block is wrapped.
    """
    context = selective_contexts if selective else noop_context_fn
    modules = _resolve(model, names, "checkpoints")
    if plain:
        _check_plain(names, modules)
        for module in modules:
            _wrap(module, functools.partial(_plain_checkpointed_forward, module.forward))
        return
    for name, module in zip(names, modules, strict=True):
        if selective and COMPILED in module.__dict__:
            # Its compiled code writes matrix products into buffers of its own (out=),
            # which the policy's cache of kept outputs reads as mutated at recompute.
            raise BlockError(
                f"block {name!r} is compiled, and selective checkpointing does not compose "
                "with a compiled forward; checkpoint it whole, or leave it uncompiled."
            )
    for name, module in zip(names, modules, strict=True):
        forward = functools.partial(_checkpointed_forward, name, module, module.forward, context)
        _wrap(module, forward)


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
    _resolve(model, config.selective_checkpoint, "checkpoints")
    _resolve(model, config.offload_activations, "offloads")
    _resolve(model, config.compile_blocks, "compiles")


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
    if not is_wrapped(module):
        replace_forward(module, forward, _ORIGINAL)


def is_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is checkpointed, selectively or not, or offloaded."""
    return _ORIGINAL in module.__dict__


def replace_forward(module: nn.Module, forward: Any, key: str) -> None:
    """Set ``module``'s instance ``forward``, keeping the one it had (or None) under ``key``."""
    module.__dict__[key] = module.__dict__.get("forward")
    module.forward = forward


def restore_forwards(model: nn.Module, key: str) -> None:
    """Give every module of ``model`` that :func:`replace_forward` changed under ``key``
    its ``forward`` back."""
    for module in model.modules():
        if key not in module.__dict__:
            continue
        previous = module.__dict__.pop(key)
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def remove_checkpointing(model: nn.Module) -> None:
    """Undo :func:`apply_checkpointing` and :func:`apply_offloading` on every block."""
    restore_forwards(model, _ORIGINAL)


# Keyword arguments through which Hugging Face layers read and write a key/value cache;
# ``cache`` (transformers 5's name) only where it holds a Hugging Face cache object, since
# a block of one's own may take tables or memories under that name.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")
_SNAPSHOT_NUMEL = 2**18
"""Buffers up to this many elements are copied before a checkpointed forward, so that the
recomputation reads them as the forward did; a larger one, changed in place, is read as
the forward left it (kept small: the copies live until the block's backward)."""
_MISMATCH = ("different number of tensors", "different metadata", "save more tensors")
"""What torch's CheckpointError says when a recomputation saved other tensors."""
_SELECTIVE_MISMATCH = "encountered during backward but not found in storage"
"""What selective checkpointing's RuntimeError says when a recomputation ran other ops."""
_KEPT_CHANGED = "cached during selective activation checkpoint has been mutated"
"""What it says when an op changed a kept output in place after it was kept."""

_last_recomputed: list[str] = [""]
"""The block recomputed last: the one a CheckpointError raised in backward is about."""


@contextlib.contextmanager
def named_recompute_errors() -> Iterator[None]:
    """Around a backward: a ``CheckpointError`` saying the block recomputed last saved
    other tensors than its forward did becomes a BlockError that names the block."""
    try:
        yield
    except CheckpointError as exc:
        if not any(words in str(exc) for words in _MISMATCH):
            raise
        raise _recompute_error(exc) from exc
    except RuntimeError as exc:
        if _KEPT_CHANGED in str(exc):
            raise _kept_changed_error() from exc
        if _SELECTIVE_MISMATCH not in str(exc):
            raise
        raise _recompute_error(exc) from exc


def _kept_changed_error() -> BlockError:
    return BlockError(
        f"block {_last_recomputed[0]!r} cannot be checkpointed selectively: an op of its "
        "forward changes the output of a matrix product or convolution in place after "
        "selective checkpointing kept it (an activation with inplace=True right after a "
        "convolution, say), so the kept output is no longer what backward needs. Checkpoint "
        "it whole instead (checkpoint, not selective_checkpoint), or tune with "
        f"{option('SearchSpace(selective_checkpointing=False)')}."
    )


def _recompute_error(exc: RuntimeError) -> BlockError:
    """The BlockError for ``exc``: the block, torch's words, and what to do."""
    text = str(exc)
    lines = text.removeprefix("torch.utils.checkpoint: ").splitlines()
    detail = " ".join(line.strip() for line in lines[:3] if line.strip())
    return BlockError(
        f"block {_last_recomputed[0]!r} cannot be checkpointed: recomputed in backward, it "
        f"saved other tensors than its forward did ({detail}). Its forward depends on state "
        "it changes (a cache, a counter, a random choice outside torch's generator). Tune "
        "without checkpointing it: name the blocks that can be with "
        f"{option('SearchSpace(blocks=[...])')}, or {option('SearchSpace(checkpointing=False)')}."
    )


def _check_plain(names: Sequence[str], modules: Sequence[nn.Module]) -> None:
    """Refuse a block whose forward updates running statistics (a batch norm in training
    mode): a plain checkpoint would recompute it on the statistics as the forward left them."""
    for name, module in zip(names, modules, strict=True):
        if any(tracks_statistics(m) for m in module.modules()):
            raise BlockError(
                f"block {name!r} updates running statistics (a batch norm), which a block "
                "checkpointed inside the compiled model cannot recompute as its forward "
                "saw them; checkpoint it with the model uncompiled or its blocks compiled "
                "(compile_model: false)."
            )


def _plain_checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return _checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _checkpointed_forward(
    name: str, module: nn.Module, forward: Any, context: Any, *args: Any, **kwargs: Any
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
        if hasattr(kwargs.get("cache"), "get_seq_length"):  # a Hugging Face Cache
            kwargs["cache"] = None
    changed: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []
    calls = 0

    def run(*a: Any, **k: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:  # the recomputation in backward: it must leave the buffers alone
            _last_recomputed[0] = name
            with _buffers_as_before(changed), _casts_every_time(context):
                return forward(*a, **k)
        with _copying():
            before = _snapshot(module)
        with _casts_every_time(context):
            out = forward(*a, **k)
        changed.extend(_changed_owners(module, before))
        return out

    return _checkpoint(run, *args, use_reentrant=False, context_fn=context, **kwargs)


@contextlib.contextmanager
def _casts_every_time(context: Any) -> Iterator[None]:
    """Inside a selectively checkpointed block, autocast casts a weight at each use.

    Selective checkpointing matches the recomputation's ops one by one against the
    forward's. Autocast caches a weight's cast for the rest of the forward, so a block
    called again in the same forward (ALBERT's one shared layer) skips the cast, while
    its recomputation in backward, under an autocast of its own, makes it: an op the
    forward never ran. Without the cache both run the same casts.
    """
    if context is not selective_contexts:
        yield
        return
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)


_copies = [0]
"""How many of this process's checkpoint wrappers are copying a block's buffers now."""


def copying_buffers() -> bool:
    """Whether a checkpoint wrapper is copying a block's buffers (BatchNorm's statistics,
    to recompute with): storages of the wrapper's, not the block's. A tracker counts their
    bytes but leaves them out when it numbers the storages a phase makes, so that a
    block's tensors have the same numbers whether it is checkpointed or kept (a CNN's
    block outputs are matched across the profile's runs by them)."""
    return _copies[0] > 0


@contextlib.contextmanager
def _copying() -> Iterator[None]:
    _copies[0] += 1
    try:
        yield
    finally:
        _copies[0] -= 1


def _snapshot(module: nn.Module) -> dict[int, tuple[int, torch.Tensor | None]]:
    """Each buffer of ``module`` by id: its in-place version, and a copy if it is small."""
    return {
        id(b): (b._version, b.clone() if b.numel() <= _SNAPSHOT_NUMEL else None)
        for b in module.buffers()
        if not b.is_inference()  # no version counter, and no in-place change outside one
    }


def _changed_owners(
    module: nn.Module, before: dict[int, tuple[int, torch.Tensor | None]]
) -> list[tuple[nn.Module, dict[str, torch.Tensor]]]:
    """The submodules of ``module`` whose forward changed their buffers in place, each
    with the values to recompute with: its buffers as they were before the forward (as
    the forward left them where too large to copy).

    A kernel may update a buffer without bumping its version (BatchNorm's running
    statistics), so a module counts as a whole: one changed buffer (BatchNorm's
    ``num_batches_tracked``) marks all of its buffers. A norm layer tracking statistics
    in training mode counts even where no counter moved (``momentum`` set, no counter).
    """
    out = []
    for owner in module.modules():
        buffers = {k: b for k, b in owner._buffers.items() if b is not None and id(b) in before}
        moved = any(before[id(b)][0] != b._version for b in buffers.values())
        if buffers and (moved or tracks_statistics(owner)):
            out.append((owner, {k: _before(b, before) for k, b in buffers.items()}))
    return out


def _before(
    buffer: torch.Tensor, before: dict[int, tuple[int, torch.Tensor | None]]
) -> torch.Tensor:
    """``buffer`` as it was before the forward, or as it is where it was too large to copy."""
    copy = before[id(buffer)][1]
    return buffer if copy is None else copy


@contextlib.contextmanager
def _buffers_as_before(
    changed: Sequence[tuple[nn.Module, dict[str, torch.Tensor]]],
) -> Iterator[None]:
    """Run the recomputation on copies of the buffers its forward changed in place.

    A block's forward may update state as it runs: BatchNorm's running statistics and
    ``num_batches_tracked`` in training mode, a moving average it reads and then updates.
    Recomputed on the buffers themselves, it would update them a second time (the model
    would evaluate differently from one trained without checkpointing) and read what the
    forward wrote. The recomputation gets copies of them as they were before the forward
    (its saved tensors may keep those for backward); the buffers hold what the forward
    wrote, once.
    """
    kept = [(owner, {k: owner._buffers[k] for k in values}) for owner, values in changed]
    with _copying():
        for owner, values in changed:
            for key, value in values.items():
                owner._buffers[key] = value.clone()
    try:
        yield
    finally:
        for owner, buffers in kept:
            owner._buffers.update(buffers)


def disable_hf_checkpointing(model: nn.Module) -> Callable[[], None]:
    """Turn off ``gradient_checkpointing`` on every module of ``model`` that has it on.

    Returns:
        A function that turns it back on where it was on.
    """
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    for m in flagged:
        m.__dict__["gradient_checkpointing"] = False  # a plain attribute, as HF sets it

    def undo() -> None:
        for m in flagged:
            m.__dict__["gradient_checkpointing"] = True

    return undo


_EXPENSIVE = (
    # Matrix products: nn.Linear (addmm, or mm and an add), matmul's bmm, Conv1D's addmm.
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_int_mm",
    # Convolutions of every dimension and their transposes.
    "convolution",
    # Fused attention kernels (the math path is plain bmm and softmax, covered above).
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
"""aten ops whose outputs a selectively checkpointed block keeps (those this torch has)."""


def _overloads(names: tuple[str, ...]) -> frozenset[Any]:
    """Every overload of the named aten ops that this build of torch has."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        found += [getattr(packet, o) for o in packet.overloads()]
    return frozenset(found)


SAVED_OPS: frozenset[Any] = _overloads(_EXPENSIVE)
"""The op overloads whose outputs are kept; every other op is recomputed in backward."""


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


selective_contexts: Callable[[], tuple[Any, Any]] = functools.partial(
    create_selective_checkpoint_contexts, _policy
)
"""The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for a selective block."""
