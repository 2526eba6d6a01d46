"""Activation offload: the tensors a block saves for backward live in host memory.

:class:`ActivationOffloader` moves them to pinned host memory as the forward makes them
(on a copy stream), and brings them back in the backward: when an offloaded block's
backward starts, the next offloaded block below it is prefetched, so its copy runs while
this block's backward computes.

It runs on any device. On CPU the host is the device: the copies are plain copies, the
math is the same, and the host side is allocated inside
:func:`~autotune.device._backend.host_memory` so that tests can check the accounting
without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from autotune.device import backend_for, host_empty

__all__ = ["ActivationOffloader"]

_MIN_BYTES = 1024
"""Saved tensors smaller than this stay on the device: a copy would cost more than it saves."""
_IN_FLIGHT = 2
"""Blocks whose forward copies may still be running when the next block starts."""


@dataclass(eq=False)
class _Moved:
    """One storage's bytes in host memory; ``restored`` is its device copy once back."""

    host: torch.Tensor
    restored: torch.Tensor | None = None


@dataclass(eq=False)
class _Packed:
    """One saved tensor: a view (dtype, shape, strides, offset) of a moved storage."""

    moved: _Moved
    call: _Call
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def restored(self) -> torch.Tensor:
        """The saved tensor, as it was, over its storage's device copy."""
        assert self.moved.restored is not None
        base = self.moved.restored.view(self.dtype)
        return base.as_strided(self.shape, self.stride, self.offset)


@dataclass(eq=False)
class _Call:
    """One forward call of an offloaded block, and what it moved to the host."""

    seq: int
    block: str
    packed: list[weakref.ref[_Packed]] = field(default_factory=list)
    seen: dict[tuple[Any, ...], tuple[weakref.ref[torch.UntypedStorage], _Moved]] = field(
        default_factory=dict
    )
    """Saved storage -> its copy; the storage is held weakly: a freed storage's address may
    be reused by a new one within the block."""
    restore_event: Any = None
    restored: bool = False
    started: bool = False
    """Its backward has begun (it has prefetched the block below)."""


class ActivationOffloader:
    """Moves the saved activations of chosen blocks to host memory and back.

    Args:
        model: The model (its parameters are never offloaded: they stay on the device).
        device: The training device.

    Attributes:
        moved_bytes: Bytes copied to the host by the last forward call of each block, by
            name (read by the profiler to predict transfer time).
        copies: The bytes of each host copy made by the last forward call of each block.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.backend = backend_for(device)
        self.streams = self.backend.streams  # copies on side streams, overlapping compute
        self._d2h = self.backend.new_stream() if self.streams else None
        self._h2d = self.backend.new_stream() if self.streams else None
        # Parameters and buffers stay on the device whatever is saved of them. (A fake
        # tensor has no address, and is never offloaded: see _offloadable.)
        held = (*model.parameters(), *model.buffers())
        self._resident = {
            t.untyped_storage().data_ptr() for t in held if not isinstance(t, FakeTensor)
        }
        self._calls: list[weakref.ref[_Call]] = []
        self._seq = itertools.count()
        self._in_flight: deque[Any] = deque()
        self.moved_bytes: dict[str, int] = {}
        self.copies: dict[str, list[int]] = {}

    def forward(self, block: str, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one block's forward, its saved tensors packed to the host."""
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        call = _Call(next(self._seq), block)
        self._calls = [c for c in self._calls if c() is not None]
        self._calls.append(weakref.ref(call))
        self.moved_bytes[block] = 0
        self.copies[block] = []
        if self.streams:  # bound the copies in flight (and the device memory they pin)
            while len(self._in_flight) >= _IN_FLIGHT:
                self.backend.current_stream().wait_event(self._in_flight.popleft())
            assert self._d2h is not None
            self._d2h.wait_stream(self.backend.current_stream())
        try:
            pack = functools.partial(self._pack, call)
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                return forward(*args, **kwargs)
        finally:
            call.seen.clear()  # the forward alone dedups; kept, calls and packs would form a cycle
            if self.streams:
                assert self._d2h is not None
                self._in_flight.append(self._d2h.record_event())

    def _pack(self, call: _Call, t: torch.Tensor) -> Any:
        """A tensor saved for backward: a view of its storage's host copy (started), or
        itself if it stays.

        The storage moves (once, however many of its views are saved: q, k and v split
        from one projection), and each view comes back as the same view of it: the same
        strides, so backward runs the same kernels, and the device holds what it would
        hold without offload. Where the view spans under half of a larger storage (the
        last position of the logits), only the bytes it spans move.
        """
        if not self._offloadable(t):
            return t
        storage = t.untyped_storage()
        size = t.element_size()
        first = int(t.storage_offset())
        last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        start, stop = 0, storage.nbytes()
        if 2 * (last + 1 - first) * size < stop:
            start, stop = first * size, (last + 1) * size
        key = (storage.data_ptr(), storage.nbytes(), t._version, start, stop)
        hit = call.seen.get(key)
        if hit is not None and hit[0]() is not None:
            moved = hit[1]
        else:
            moved = self._move(call, storage, start, stop)
            call.seen[key] = (weakref.ref(storage), moved)
        offset = first - start // size
        packed = _Packed(moved, call, t.dtype, tuple(t.shape), t.stride(), offset)
        call.packed.append(weakref.ref(packed))
        return packed

    def _move(self, call: _Call, storage: torch.UntypedStorage, start: int, stop: int) -> _Moved:
        """Start copying bytes ``start`` to ``stop`` of ``storage`` to the host."""
        whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        data = whole[start:stop]
        host = host_empty(data, pinned=self.backend.pins)
        if self.streams:
            assert self._d2h is not None
            self._d2h.wait_stream(self.backend.current_stream())
            with self.backend.use_stream(self._d2h):
                host.copy_(data, non_blocking=True)
            self.backend.record_stream(data, self._d2h)  # its memory is reused only after the copy
        else:
            host.copy_(data)
        self.moved_bytes[call.block] += host.nbytes
        self.copies[call.block].append(host.nbytes)
        return _Moved(host)

    def host_bytes(self) -> int:
        """Host bytes the last forward call of every block holds, as allocated."""
        return sum(self.backend.host_bytes(n) for sizes in self.copies.values() for n in sizes)

    def _unpack(self, packed: Any) -> torch.Tensor:
        """A saved tensor needed in backward: restored (and the block below prefetched)."""
        if not isinstance(packed, _Packed):
            return packed  # type: ignore[no-any-return]
        call = packed.call
        if not call.started:  # first use: this block's backward has begun
            call.started = True
            if not call.restored:  # nothing prefetched it (the top offloaded block)
                self._restore(call)
            self._prefetch_below(call)
        if self.streams and call.restore_event is not None:
            self.backend.current_stream().wait_event(call.restore_event)
        return packed.restored()

    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.device != self.device or t.layout != torch.strided or type(t) is not torch.Tensor:
            return False  # parameters (a subclass) and host tensors stay where they are
        if t.numel() * t.element_size() < _MIN_BYTES or t.is_conj() or t.is_neg():
            return False  # a lazy conjugate or negation is a flag a byte copy would drop
        storage = t.untyped_storage()
        if storage.nbytes() % t.element_size():
            return False  # bytes another dtype laid out: not a view of this one's
        return storage.data_ptr() not in self._resident

    def _restore(self, call: _Call) -> None:
        """Copy a block call's tensors back to the device (on the copy stream on CUDA)."""
        call.restored = True
        packs = (p for p in (r() for r in call.packed) if p is not None)
        moved = list({id(p.moved): p.moved for p in packs if p.moved.restored is None}.values())
        if self.streams:
            assert self._h2d is not None and self._d2h is not None
            self._h2d.wait_stream(self.backend.current_stream())
            self._h2d.wait_stream(self._d2h)  # the forward copies must have landed
        for m in moved:
            dev = torch.empty_like(m.host, device=self.device)
            if self.streams:
                assert self._h2d is not None
                with self.backend.use_stream(self._h2d):
                    dev.copy_(m.host, non_blocking=True)
                self.backend.record_stream(dev, self._h2d)
            else:
                dev.copy_(m.host)
            m.restored = dev
        if self.streams:
            assert self._h2d is not None
            call.restore_event = self._h2d.record_event()

    def _prefetch_below(self, call: _Call) -> None:
        """Start restoring the offloaded call that ran just before ``call`` in the forward."""
        earlier = [
            c
            for c in (r() for r in self._calls)
            if c is not None and c.seq < call.seq and not c.restored
        ]
        if earlier:
            self._restore(max(earlier, key=lambda c: c.seq))
