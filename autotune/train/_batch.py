"""Batches of any structure: measuring, resizing, splitting and moving them.

A batch is a Tensor, a tuple/list (namedtuples included) or a Mapping (a dict, or a Hugging
Face ``BatchEncoding``: a ``UserDict``, not a dict), nested freely. Tensors with at least one
dimension share batch dimension 0; other leaves (ints, strings, None, 0-dim tensors) pass
through unchanged. This runs every training step: one walk, no copies where a view will do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from operator import itemgetter
from typing import Any

import torch
from torch import Tensor

from autotune.errors import BatchError
from autotune.train._batch_layout import layout_of, on_host

__all__ = [
    "Batch",
    "batch_size",
    "bytes_per_sample",
    "counted_tokens",
    "map_tensors",
    "pinned",
    "resize",
    "shares",
    "split",
    "step_batch",
    "tensors_on",
    "to_device",
    "widest_bytes",
    "widest_first",
]

Batch = Any
"""A Tensor, tuple/list or Mapping of tensors (nested freely) sharing batch dimension 0."""

_SUPPORTED = "a Tensor, a tuple/list, or a Mapping (dict, BatchEncoding) of tensors"


def _check_type(batch: Batch) -> None:
    # Only the top level is strict: nested non-tensors are the user's extra inputs.
    if not isinstance(batch, (Tensor, tuple, list, Mapping)):
        raise BatchError(f"batch type {type(batch).__name__} is not supported: pass {_SUPPORTED}")


def _rebuild(container: Any, items: list[Any]) -> Any:
    """A container of ``container``'s type holding ``items`` (the values, for a Mapping)."""
    kind: Any = type(container)
    if kind is tuple or kind is list:  # the common cases first: this runs every step
        return kind(items)
    if isinstance(container, Mapping):
        new = dict(zip(container, items, strict=True))
        try:  # BatchEncoding(dict) works; a Mapping whose constructor wants more gets a dict
            return new if kind is dict else kind(new)
        except Exception:
            return new
    if hasattr(kind, "_fields"):  # namedtuple: the fields are positional arguments
        return kind(*items)
    try:  # other tuple/list subclasses, e.g. torch.return_types
        return kind(items)
    except Exception:
        return tuple(items) if isinstance(container, tuple) else items


def _map(batch: Batch, fn: Callable[[Tensor], Tensor], min_ndim: int) -> Batch:
    # A tensor that is several leaves (a causal LM's labels=input_ids) maps once, so that
    # its leaves stay one tensor: resized, split or moved, it holds its bytes once.
    done: dict[int, Tensor] = {}

    def once(t: Tensor) -> Tensor:
        out = done.get(id(t))
        if out is None:
            out = done[id(t)] = fn(t)
        return out

    return _walk(batch, once, min_ndim)


def _walk(batch: Batch, fn: Callable[[Tensor], Tensor], min_ndim: int) -> Batch:
    if isinstance(batch, Tensor):
        return fn(batch) if batch.ndim >= min_ndim else batch
    if isinstance(batch, Mapping):
        return _rebuild(batch, [_walk(v, fn, min_ndim) for v in batch.values()])
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [_walk(v, fn, min_ndim) for v in batch])
    return batch


def map_tensors(batch: Batch, fn: Callable[[Tensor], Tensor], *, min_ndim: int = 1) -> Batch:
    """Applies ``fn`` to every tensor leaf with at least ``min_ndim`` dimensions.

    Args:
        batch: A Tensor, tuple/list or Mapping, nested freely.
        fn: Maps one tensor to another (usually with the same number of rows or fewer).
        min_ndim: Leaves with fewer dimensions pass unchanged.

    Returns:
        The same structure and container types, with ``fn`` applied to the tensor leaves.
    """
    _check_type(batch)
    return _map(batch, fn, min_ndim)


def _leaves(batch: Batch, path: str) -> Iterator[tuple[str, Tensor]]:
    """Yields ``(path, tensor)`` for each tensor leaf with at least one dimension."""
    if isinstance(batch, Tensor):
        if batch.ndim >= 1:
            yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        fields = getattr(batch, "_fields", None)  # a namedtuple: name its fields in messages
        names = [f".{f}" for f in fields] if fields else [f"[{i}]" for i in range(len(batch))]
        for name, value in zip(names, batch, strict=False):
            yield from _leaves(value, path + name)


def batch_size(batch: Batch) -> int:
    """The number of samples in ``batch``: the dim-0 size its tensors share.

    Raises:
        BatchError: The type is unsupported, no tensor has a dimension, sizes disagree, or
            the batch has no rows.
    """
    _check_type(batch)
    layout = layout_of(batch)
    if layout is not None:
        return layout.size(batch)
    first: tuple[str, int] | None = None
    for path, tensor in _leaves(batch, "batch"):
        rows = tensor.shape[0]
        if first is None:
            first = (path, rows)
        elif rows != first[1]:
            raise BatchError(
                f"{first[0]} has {first[1]} rows but {path} has {rows}: every tensor in a batch "
                "must share dimension 0 (pass per-batch values as 0-dim tensors or plain values), "
                "or describe how the batch holds its samples with a layout of your own "
                "(autotune.add_batch_layout)"
            )
    if first is None:
        raise BatchError(
            "the batch holds no tensor with a dimension, so its size is unknown: "
            f"pass {_SUPPORTED} whose dimension 0 is the batch"
        )
    if first[1] == 0:
        raise BatchError(f"the batch is empty ({first[0]} has 0 rows): pass at least one sample")
    return first[1]


def resize(batch: Batch, n: int) -> Batch:
    """A batch of exactly ``n`` samples made from ``batch``.

    Shrinking keeps the first ``n`` rows (views); growing repeats rows cyclically, so row
    ``i`` of the result is row ``i % batch_size(batch)`` (new contiguous tensors).

    Raises:
        BatchError: ``n`` is below 1, or ``batch`` is not a valid batch.
    """
    if n < 1:
        raise BatchError(f"cannot resize a batch to {n} samples: ask for 1 or more")
    size = batch_size(batch)
    layout = layout_of(batch)
    if layout is not None:
        if n <= size:
            return layout.take(batch, 0, n)
        whole, rest = divmod(n, size)
        parts = [batch] * whole + ([layout.take(batch, 0, rest)] if rest else [])
        # New tensors, as rows grow into: a loader's batch holds distinct samples (a
        # layout's join may keep its parts' tensors, as a list of samples does).
        return layout.join([map_tensors(p, torch.clone) for p in parts])
    if n <= size:
        return _map(batch, lambda t: t[:n], 1)
    indices: dict[torch.device, Tensor] = {}  # one index per device the batch spans

    def grow(t: Tensor) -> Tensor:
        if t.device not in indices:
            indices[t.device] = torch.arange(n, device=t.device) % size
        return t.index_select(0, indices[t.device])

    return _map(batch, grow, 1)


def widest_first(batch: Batch) -> Batch:
    """``batch`` with the samples that cost most in a micro-batch first, where its layout
    says which (a list of images of different sizes, which a detection model pads to the
    largest), so that micro-batches cut from its start hold the widest it can; rows of
    one shape as they are."""
    layout = layout_of(batch)
    return batch if layout is None else layout.widest_first(batch)


def step_batch(sample: Batch, n: int, micro_batch_size: int) -> Batch:
    """A step's batch of ``n`` samples made from ``sample`` (see :func:`resize`); where
    its layout pads a micro-batch to its widest sample (:func:`widest_first`), each
    micro-batch is the sample's first ``micro_batch_size`` samples (new tensors), as the
    profile measured a micro-batch: the widest a micro-batch of the sample can be."""
    layout = layout_of(sample)
    if layout is None or not layout.pads or n <= micro_batch_size:
        return resize(sample, n)
    whole, rest = divmod(n, micro_batch_size)
    parts = [resize(sample, micro_batch_size)] * whole + ([resize(sample, rest)] if rest else [])
    return layout.join([map_tensors(p, torch.clone) for p in parts])


def split(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Consecutive chunks of ``micro_batch_size`` rows (the last may be smaller), as views.

    Raises:
        BatchError: ``micro_batch_size`` is below 1, or ``batch`` is not a valid batch.
    """
    if micro_batch_size < 1:
        raise BatchError(f"micro_batch_size must be 1 or more, got {micro_batch_size}")
    size = batch_size(batch)
    layout = layout_of(batch)
    if layout is not None:
        return [
            layout.take(batch, i, min(i + micro_batch_size, size))
            for i in range(0, size, micro_batch_size)
        ]
    rows = [slice(i, i + micro_batch_size) for i in range(0, size, micro_batch_size)]
    # itemgetter rather than a lambda in the loop, which would see only the last slice
    return [_map(batch, itemgetter(s), 1) for s in rows]


def shares(
    batch: Batch,
    parts: list[Batch],
    offset: int | None = None,
    over_ranks: Callable[[Tensor], Tensor] | None = None,
) -> list[float | Tensor]:
    """What each part of ``batch`` weighs in the mean loss over them all: its share of the
    samples, or what the batch's layout weighs (a packed row's label tokens; a part of
    one sequence is a row of its own, but still weighs its tokens).

    ``offset``: the loss is a mean over the label tokens that count (labels not -100),
    less the first ``offset`` positions of each row, which it never predicts (1: a
    causal language model's): parts of rows of token labels (a dict's ``"labels"``, a
    tuple's last item) then weigh their counted tokens, each share a 0-dim tensor where
    the labels are, computed with no read on the host. A part without a counted token
    weighs nothing (its mean loss is not finite, as one batch of those rows would be).
    ``over_ranks``: under data parallelism, from this rank's count of counted tokens, the
    mean count over the ranks, which the parts' counts are then divided by: the ranks'
    mean gradient is the whole step's, not a mean of the ranks' own token means.

    Raises:
        BatchError: ``offset`` is given, but a batch with no layout holds no token labels.
    """
    layout = layout_of(batch)
    if layout is None and offset is not None:
        labels = _token_labels(batch)
        counted = [counted_tokens(p, offset) for p in parts]
        if over_ranks is None and on_host(labels):  # read by Python: no device waits
            return _over_total([c.tolist() for c in counted])  # 0-dim: a number
        tokens = torch.stack(counted).sum()
        if over_ranks is not None:
            tokens = over_ranks(tokens)
        return [c / tokens for c in counted]
    sizes = [layout.share(p) if layout is not None else float(batch_size(p)) for p in parts]
    return _over_total(sizes)


def _over_total(sizes: list[Any]) -> list[float | Tensor]:
    """Each of ``sizes`` over their sum (a tensor where a count is one)."""
    total = sum(sizes)
    return [size / total for size in sizes]


_IGNORED = -100
"""The label of a token that does not count (Hugging Face's, and torch's default)."""


def counted_tokens(batch: Batch, offset: int) -> Tensor:
    """The label tokens that count in ``batch`` (not -100), less the first ``offset`` of
    each row: a 0-dim tensor where its labels are (see :func:`shares`).

    Raises:
        BatchError: ``batch`` holds no label per token.
    """
    return (_token_labels(batch)[..., offset:] != _IGNORED).sum()


def _token_labels(batch: Batch) -> Tensor:
    """The labels per token ``batch`` holds: a Mapping's ``"labels"``, a tuple's or a
    list's last item (the target a ``loss_fn`` reads), rows of integers.

    Raises:
        BatchError: it holds none.
    """
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) > 1:
        labels = batch[-1]
    else:
        labels = None
    if isinstance(labels, Tensor) and labels.ndim >= 2 and not labels.is_floating_point():
        return labels
    raise BatchError(
        "the loss is a mean over label tokens, so each micro-batch weighs its tokens, but "
        "the batch holds no label per token (a dict's 'labels', or a tuple's last item: "
        "integer rows, -100 where a token does not count); pass loss_mean='samples' where "
        "the loss is a mean over samples"
    )


def tensors_on(batch: Batch, device: torch.device) -> list[Tensor]:
    """The tensor leaves of ``batch`` that already live on ``device``: memory the step
    holds from start to end (a leaf elsewhere is copied up one micro-batch at a time)."""
    return [t for _, t in _leaves(batch, "batch") if t.device == device]


def bytes_per_sample(batch: Batch, device: torch.device) -> float:
    """Bytes one sample of ``batch`` holds on ``device`` (0 where it lives elsewhere)."""
    return _held(batch, device) / batch_size(batch)


def widest_bytes(batch: Batch, device: torch.device) -> tuple[int, ...]:
    """Where ``batch``'s layout pads: the bytes its first 1, 2, ... samples hold on
    ``device``, each of a step's micro-batches (:func:`step_batch`); else none."""
    layout = layout_of(batch)
    if layout is None or not layout.pads:
        return ()
    return tuple(_held(layout.take(batch, 0, k), device) for k in range(1, batch_size(batch) + 1))


def _held(batch: Batch, device: torch.device) -> int:
    """Bytes ``batch``'s tensors hold on ``device``, each counted once."""
    leaves = {id(t): t for t in tensors_on(batch, device)}.values()  # labels=input_ids: once
    return sum(t.numel() * t.element_size() for t in leaves)


def pinned(batch: Batch) -> Batch:
    """``batch`` with its host tensors in pinned memory (those pinned already as they are),
    so that a non-blocking copy to a GPU runs behind the host instead of stalling it."""
    return _map(
        batch, lambda t: t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory(), 0
    )


def to_device(batch: Batch, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
    """``batch`` with every tensor leaf moved to ``device`` by ``Tensor.to``.

    0-dim tensors move too, unlike in the other functions: a transfer that left some
    tensors behind would only fail later, inside the model, with a device mismatch.
    """
    _check_type(batch)
    return _map(batch, lambda t: t.to(device, non_blocking=non_blocking), 0)
