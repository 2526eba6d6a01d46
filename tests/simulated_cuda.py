"""A CPU stand-in for the CUDA caching allocator's statistics, so that CI runs the CUDA
logic of autotune (reserved peaks, the context, foreign bytes, the cap) on CPU tensors.

Every storage the CPU allocates while it is active goes through the allocator's model
(:mod:`autotune.device._caching_allocator`: PyTorch's CUDACachingAllocator's rules of
rounding, pools, splits, merges and release-and-retry), with the cap (or the device's
memory) as its limit: a request it cannot serve raises ``torch.OutOfMemoryError``. It
runs the same autotune code the GPU runs, behind :class:`autotune.device._backend.Backend`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autotune.device._allocator_trace import RequestLog
from autotune.device._backend import Backend, RequestBox, in_host_memory, is_host_storage
from autotune.device._caching_allocator import AllocatorSettings, CachingAllocator, OutOfMemory


class SimulatedAllocator(TorchDispatchMode):
    """Sees every CPU storage allocated while it is active and keeps CUDA-like statistics."""

    def __init__(self, total: int, settings: str = "") -> None:
        super().__init__()
        self.total = total
        self.cap: int | None = None
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.high_water = 0
        self.host_cache_releases = 0
        self.context = 0
        """Device memory outside the allocator, as a test sets it (kernels load lazily)."""
        """The most ever reserved (``peak`` is reset by measurements, this never is)."""
        self.settings = settings
        """Its settings, as the allocator reports those in force (its snapshot's)."""
        self.model = CachingAllocator(AllocatorSettings.parse(settings))
        """The allocator's rules, fed the CPU's real requests and frees."""
        self.log: RequestLog | None = None
        """The requests being recorded (see :meth:`SimulatedCuda.requests`)."""
        self._made: dict[int, int] = {}  # address -> allocation, while recorded
        self._seen: set[int] = set()
        self.compute = SimulatedStream()
        """The stream compute runs on; side streams made by the offloaders are in ``streams``."""
        self.streams: list[SimulatedStream] = [self.compute]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if in_host_memory():
            return out
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if (
                    key not in inputs
                    and key not in self._seen
                    and storage.nbytes()  # no bytes: never reaches the allocator
                    and not is_host_storage(storage)
                ):
                    self._allocate(storage)
        return out

    def _allocate(self, storage: torch.UntypedStorage) -> None:
        limit = self.total - self.context if self.cap is None else min(self.cap, self.total)
        self.model.limit = limit
        try:
            block = self.model.malloc(storage.nbytes())
        except OutOfMemory as exc:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated): {exc}") from None
        self._seen.add(id(storage))
        weakref.finalize(storage, self._free, id(storage), block.address)
        self._update()
        if self.log is not None:
            self._made[block.address] = len(self.log.allocations)
            self.log.order.append(len(self.log.allocations))
            self.log.allocations.append((storage.nbytes(), 0))

    def _free(self, key: int, address: int) -> None:
        self._seen.discard(key)
        self.model.free(address)
        self._update()
        if self.log is not None and address in self._made:
            self.log.order.append(-1 - self._made.pop(address))

    def _update(self) -> None:
        self.reserved, self.allocated = self.model.reserved, self.model.allocated_bytes
        self.peak = max(self.peak, self.reserved)
        self.high_water = max(self.high_water, self.reserved)

    def empty_cache(self) -> None:
        self.model.empty_cache()
        self._update()


class SimulatedEvent:
    """A point in a simulated stream's work. CPU work is synchronous, so it is done at
    once, unless its stream ``lags`` (a GPU behind the host): then it is done once waited
    for."""

    def __init__(self, stream: SimulatedStream) -> None:
        self.stream = stream
        self.done = not stream.lags

    def query(self) -> bool:
        self.stream._count("query")
        return self.done

    def synchronize(self) -> None:
        self.stream._count("event_synchronize")
        self.done = True


class SimulatedStream:
    """A stream whose work runs in order on the CPU; it counts what it is asked to do."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.lags = False
        """Whether its events are done only once waited for (a device behind the host)."""

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def wait_stream(self, other: SimulatedStream) -> None:
        assert isinstance(other, SimulatedStream)
        self._count("wait_stream")

    def record_event(self) -> SimulatedEvent:
        self._count("record_event")
        return SimulatedEvent(self)

    def wait_event(self, event: SimulatedEvent) -> None:
        assert isinstance(event, SimulatedEvent)
        self._count("wait_event")

    def synchronize(self) -> None:
        self._count("synchronize")


class SimulatedCuda(Backend):
    """:class:`~autotune.device._backend.Backend` over a :class:`SimulatedAllocator`, with
    streams that run in order. Host buffers are not pinned (a CPU build cannot pin), but
    are counted as torch's pinned allocator takes them."""

    caching = True
    streams = True
    pins = False
    rounds_host = True
    host_is_device = False

    def __init__(self, device: torch.device, *, allocator: SimulatedAllocator) -> None:
        super().__init__(device)
        self.allocator = allocator

    def new_stream(self) -> SimulatedStream:
        stream = SimulatedStream()
        self.allocator.streams.append(stream)
        return stream

    def current_stream(self) -> SimulatedStream:
        return self.allocator.compute

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        assert isinstance(stream, SimulatedStream) and tensor.device.type == "cpu"
        stream._count("record_stream")

    def name(self) -> str:
        return "Simulated GPU"

    def free(self) -> int:
        return self.allocator.total - self.allocator.reserved - self.allocator.context

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    @contextlib.contextmanager
    def requests(self) -> Iterator[RequestBox]:
        allocator = self.allocator
        log = RequestLog(start=allocator.model.snapshot(), settings=allocator.settings)
        allocator.log, allocator._made = log, {}
        box = RequestBox(lambda: len(log.order))
        try:
            yield box
        finally:
            allocator.log = None
            log.cuts, box.log = box.cuts, log

    def empty_host_cache(self) -> None:
        self.allocator.host_cache_releases += 1

    def reset_peak(self) -> None:
        self.allocator.peak = self.allocator.reserved

    def reserved(self) -> int:
        return self.allocator.reserved

    def max_reserved(self) -> int:
        return self.allocator.peak

    def total(self) -> int:
        return self.allocator.total

    def context_bytes(self) -> int:
        return self.allocator.context

    def capped(self) -> bool:
        return self.allocator.cap is not None and self.allocator.cap < self.allocator.total

    @contextlib.contextmanager
    def cap(self, nbytes: int | None) -> Iterator[None]:
        if nbytes is None:
            yield
            return
        previous, self.allocator.cap = self.allocator.cap, min(max(nbytes, 0), self.total())
        try:
            yield
        finally:
            self.allocator.cap = previous


class SeparateHost(Backend):
    """The CPU as a device whose host memory is separate (as a GPU's is), nothing else:
    live bytes stay the peak, exactly, so offload's accounting is tested to the byte."""

    host_is_device = False
