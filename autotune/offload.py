"""Offload: saved activations and the optimizer live in host memory, copies overlapped.

* :class:`ActivationOffloader` moves the tensors a block saves for backward to pinned host
  memory as the forward makes them (on a copy stream), and brings them back in the
  backward: when an offloaded block's backward starts, the next offloaded block below it
  is prefetched, so its copy runs while this block's backward computes.
* :class:`OptimizerOffloader` keeps fp32 master weights, gradients and optimizer state on
  the host. In the last micro-batch of a step each gradient is copied down as soon as
  autograd has accumulated it (overlapping the rest of the backward) and freed on the
  device; the step runs on the host; the updated weights go back up on a copy stream that
  the compute stream waits for before it touches them.

Both run on any device. On CPU the host is the device: the copies are plain copies, the
math is the same, and the host side is allocated inside :func:`~autotune.memory.host_memory`
so that tests can check offload's accounting without a GPU.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .memory import host_memory, mark_host

__all__ = ["ActivationOffloader", "OptimizerOffloader", "host_empty"]

_MIN_BYTES = 1024
"""Saved tensors smaller than this stay on the device: a copy would cost more than it saves."""
_IN_FLIGHT = 2
"""Blocks whose forward copies may still be running when the next block starts."""


def host_empty(like: torch.Tensor, *, pinned: bool) -> torch.Tensor:
    """An empty contiguous host tensor shaped like ``like`` (pinned for CUDA transfers)."""
    with host_memory():
        out = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
    mark_host((out,))
    return out


@dataclass(eq=False)
class _Packed:
    """One saved tensor in host memory; ``restored`` is its device copy once back."""

    host: torch.Tensor
    call: _Call
    restored: torch.Tensor | None = None


@dataclass(eq=False)
class _Call:
    """One forward call of an offloaded block, and what it moved to the host."""

    seq: int
    block: str
    packed: list[weakref.ref[_Packed]] = field(default_factory=list)
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
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if self.cuda else None
        self._h2d = torch.cuda.Stream(device) if self.cuda else None
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._calls: list[weakref.ref[_Call]] = []
        self._seq = itertools.count()
        self._in_flight: deque[Any] = deque()
        self.moved_bytes: dict[str, int] = {}

    def forward(self, block: str, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one block's forward, its saved tensors packed to the host."""
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        call = _Call(next(self._seq), block)
        self._calls = [c for c in self._calls if c() is not None]
        self._calls.append(weakref.ref(call))
        self.moved_bytes[block] = 0
        # Saved tensor -> its copy; the storage is held weakly: a freed tensor's address may
        # be reused by a new tensor of the same shape within the block.
        seen: dict[tuple[Any, ...], tuple[weakref.ref[torch.UntypedStorage], _Packed]] = {}
        if self.cuda:  # bound the copies in flight (and the device memory they pin)
            while len(self._in_flight) >= _IN_FLIGHT:
                torch.cuda.current_stream(self.device).wait_event(self._in_flight.popleft())
            assert self._d2h is not None
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))

        def pack(t: torch.Tensor) -> Any:
            if not self._offloadable(t):
                return t
            key = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                t._version,
            )
            hit = seen.get(key)
            if hit is not None and hit[0]() is not None:
                return hit[1]  # the same tensor saved by several ops (e.g. q, k, v): one copy
            host = host_empty(t, pinned=self.cuda)
            if self.cuda:
                assert self._d2h is not None
                self._d2h.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._d2h):
                    host.copy_(t, non_blocking=True)
                t.record_stream(self._d2h)  # its memory is reused only after the copy
            else:
                host.copy_(t)
            packed = _Packed(host, call)
            call.packed.append(weakref.ref(packed))
            seen[key] = (weakref.ref(t.untyped_storage()), packed)
            self.moved_bytes[block] += host.nbytes
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            if not isinstance(packed, _Packed):
                return packed  # type: ignore[no-any-return]
            call = packed.call
            if not call.started:  # first use: this block's backward has begun
                call.started = True
                if not call.restored:  # nothing prefetched it (the top offloaded block)
                    self._restore(call)
                self._prefetch_below(call)
            if self.cuda and packed.call.restore_event is not None:
                torch.cuda.current_stream(self.device).wait_event(packed.call.restore_event)
            assert packed.restored is not None
            return packed.restored

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return forward(*args, **kwargs)
        finally:
            if self.cuda:
                assert self._d2h is not None
                self._in_flight.append(self._d2h.record_event())

    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.device != self.device or t.layout != torch.strided or type(t) is not torch.Tensor:
            return False  # parameters (a subclass) and host tensors stay where they are
        if t.numel() * t.element_size() < _MIN_BYTES:
            return False
        return t.untyped_storage().data_ptr() not in self._params

    def _restore(self, call: _Call) -> None:
        """Copy a block call's tensors back to the device (on the copy stream on CUDA)."""
        call.restored = True
        packs = [p for p in (r() for r in call.packed) if p is not None and p.restored is None]
        if self.cuda:
            assert self._h2d is not None and self._d2h is not None
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))
            self._h2d.wait_stream(self._d2h)  # the forward copies must have landed
        for p in packs:
            dev = torch.empty(p.host.shape, dtype=p.host.dtype, device=self.device)
            if self.cuda:
                assert self._h2d is not None
                with torch.cuda.stream(self._h2d):
                    dev.copy_(p.host, non_blocking=True)
                dev.record_stream(self._h2d)
            else:
                dev.copy_(p.host)
            p.restored = dev
        if self.cuda:
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


class OptimizerOffloader:
    """Host-side optimizer: master weights, gradients and state in (pinned) host memory.

    Args:
        params: The trainable parameters, on the device.
        device: The training device.
        build: Builds the optimizer over the host master weights.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        device: torch.device,
        build: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.params = list(params)
        self.masters = []
        for p in self.params:
            master = host_empty(p, pinned=self.cuda)
            master.copy_(p.detach())
            master.requires_grad_(p.requires_grad)
            self.masters.append(master)
        self._d2h = torch.cuda.Stream(device) if self.cuda else None
        self._h2d = torch.cuda.Stream(device) if self.cuda else None
        with host_memory():
            self.optimizer = build(self.masters)
        self.collect = False
        """True during the last micro-batch's backward: gradients go to the host as made."""
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self.collect and p.grad is not None:
            self._to_host(self._index[id(p)])

    def _to_host(self, i: int) -> None:
        p, master = self.params[i], self.masters[i]
        assert p.grad is not None
        if master.grad is None:
            master.grad = host_empty(p.grad, pinned=self.cuda)
        if self.cuda:
            assert self._d2h is not None
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                master.grad.copy_(p.grad, non_blocking=True)
            p.grad.record_stream(self._d2h)
        else:
            master.grad.copy_(p.grad)
        p.grad = None  # freed on the device once the copy is done

    def gather(self) -> None:
        """Bring every gradient still on the device to the host, and wait for all copies."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._to_host(i)
        if self.cuda:
            assert self._d2h is not None
            self._d2h.synchronize()

    def step(self, run: Callable[[torch.optim.Optimizer], None]) -> None:
        """Gather gradients, run ``run(optimizer)`` on the host, send the weights back up."""
        self.gather()
        self.host_step(run)
        self.upload()

    def host_step(self, run: Callable[[torch.optim.Optimizer], None]) -> None:
        """Run ``run(optimizer)`` over the host master weights (gradients gathered)."""
        with host_memory():
            run(self.optimizer)
            mark_host(t for s in self.optimizer.state.values() for t in _tensors(s))

    def upload(self) -> None:
        """Copy the master weights into the device parameters (asynchronously on CUDA)."""
        if not self.cuda:
            with torch.no_grad():
                for p, master in zip(self.params, self.masters, strict=True):
                    p.copy_(master)
            return
        assert self._h2d is not None
        self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._h2d):
            for p, master in zip(self.params, self.masters, strict=True):
                p.data.copy_(master, non_blocking=True)
        # Whatever runs next on the compute stream (the next forward, a state_dict copy)
        # sees the new weights; the CPU is not blocked.
        torch.cuda.current_stream(self.device).wait_stream(self._h2d)

    def zero_grad(self) -> None:
        """Drop the gradients, on the host and on the device."""
        for p, master in zip(self.params, self.masters, strict=True):
            p.grad = None
            master.grad = None

    def host_bytes(self) -> int:
        """Host bytes held: master weights, gradient buffers and optimizer state."""
        tensors = [*self.masters, *(m.grad for m in self.masters if m.grad is not None)]
        tensors += [t for s in self.optimizer.state.values() for t in _tensors(s)]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def close(self) -> None:
        """Remove the gradient hooks (the runner switched away from offload)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]
