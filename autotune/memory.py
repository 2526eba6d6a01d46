"""Peak device memory: one definition per device, used everywhere.

* **CPU**: the peak of live tensor-storage bytes, counted exactly by
  :class:`LiveBytesTracker`, a ``TorchDispatchMode`` that sees every storage an op
  allocates and is told (by a weak-reference finalizer) when it is freed. Storages that
  existed before the measured region (parameters, buffers, gradients, optimizer state)
  are registered with :meth:`LiveBytesTracker.track`.
* **CUDA**: the caching allocator's reserved peak plus the CUDA context, minus what other
  tensors of this process already held when the measurement began.

On CPU nothing runs out of memory at a budget, so the tracker doubles as a **budget
guard**: it raises ``torch.OutOfMemoryError`` the moment live bytes pass the budget. Every
OOM path of autotune is tested on CPU with it.

Host memory that offload keeps on purpose (pinned activation copies, host optimizer
state) is not device memory. On CUDA the tracker never sees it; on CPU, where the host
is the device, the offload code allocates it inside :func:`host_memory` and the tracker
leaves it out, so that offload's accounting can be tested without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "LiveBytesTracker",
    "PeakReading",
    "PhaseRecord",
    "host_memory",
    "mark_host",
    "measure_peak",
    "state_tensors",
]

_HOST = threading.local()
_HOST_STORAGES: dict[int, int] = {}  # id(storage) -> data_ptr, while the storage lives


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Storages allocated inside are host memory, not device memory: trackers skip them."""
    _HOST.depth = getattr(_HOST, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST.depth -= 1


def mark_host(tensors: Iterable[torch.Tensor]) -> None:
    """Declare the storages of ``tensors`` host memory (e.g. a host optimizer's state)."""
    for t in tensors:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in _HOST_STORAGES:
            _HOST_STORAGES[key] = storage.data_ptr()
            weakref.finalize(storage, _HOST_STORAGES.pop, key, None)


def _in_host_memory() -> bool:
    return getattr(_HOST, "depth", 0) > 0


@dataclass
class PhaseRecord:
    """Live bytes around one labelled stretch of a step (see :meth:`LiveBytesTracker.phase`)."""

    key: Any
    entry: int
    peak: int
    exit: int = 0


class LiveBytesTracker(TorchDispatchMode):
    """Counts live storage bytes on one device type; optionally enforces a budget.

    Args:
        device_type: Only storages on this device type are counted (``"cpu"``, ``"cuda"``).
        budget_bytes: If given, raise ``torch.OutOfMemoryError`` when live bytes exceed it.
    """

    def __init__(self, device_type: str = "cpu", *, budget_bytes: int | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.budget_bytes = budget_bytes
        self.live = 0
        self.peak = 0
        self.phases: list[PhaseRecord] = []
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes, while the storage lives

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of tensors that already exist (model and optimizer state)."""
        for t in tensors:
            self._add(t.untyped_storage(), check_budget=False)

    def phase(self, key: Any) -> None:
        """Close the current phase and open one labelled ``key`` at the current live bytes."""
        if self.phases:
            self.phases[-1].exit = self.live
        self.phases.append(PhaseRecord(key, self.live, self.live))

    def close(self) -> None:
        """Close the last phase (call once the measured region is over)."""
        if self.phases:
            self.phases[-1].exit = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _in_host_memory():
            return out
        inputs = {
            id(s): s
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and _has_storage(t)
            for s in (t.untyped_storage(),)
        }
        schema = getattr(func, "_schema", None)
        if schema is None or schema.is_mutable:
            # An out= or resize_ op may resize a counted storage in place: count the change.
            for key, storage in inputs.items():
                if key in self._sizes and storage.nbytes() != self._sizes[key]:
                    delta = storage.nbytes() - self._sizes[key]
                    self._sizes[key] = storage.nbytes()
                    self._grow(delta, check_budget=True)
        for t in tree_flatten(out)[0]:
            # An output sharing an input's storage is a view or an in-place result: no new bytes.
            if isinstance(t, torch.Tensor) and _has_storage(t):
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._add(storage, check_budget=True)
        return out

    def _add(self, storage: torch.UntypedStorage, *, check_budget: bool) -> None:
        key = id(storage)
        if key in self._sizes or storage.device.type != self.device_type or key in _HOST_STORAGES:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        weakref.finalize(storage, self._free, key)
        self._grow(nbytes, check_budget=check_budget)

    def _grow(self, nbytes: int, *, check_budget: bool) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        if self.phases and self.live > self.phases[-1].peak:
            self.phases[-1].peak = self.live
        if check_budget and self.budget_bytes is not None and self.live > self.budget_bytes:
            raise torch.OutOfMemoryError(
                # Worded like torch's own ("CPU out of memory."), so that tools which
                # recognise OOMs by message (accelerate, Hugging Face) react as to a real one.
                f"{self.device_type.upper()} out of memory. autotune budget guard: {self.live} "
                f"live bytes on {self.device_type} "
                f"exceed the budget of {self.budget_bytes} bytes"
            )

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


def _has_storage(t: torch.Tensor) -> bool:
    # Sparse, nested and wrapper-subclass tensors have no plain storage; they are not counted.
    plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter
    return plain and t.layout == torch.strided and not t.is_meta


def state_tensors(*objects: Any) -> list[torch.Tensor]:
    """The tensors held by modules, optimizers and GradScalers: the persistent state of a step."""
    out: list[torch.Tensor] = []
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
            out.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.amp.GradScaler):
            # Its state_dict() holds Python numbers (.item()), not the tensors it keeps.
            flat = tree_flatten(vars(obj))[0]
            out.extend(v for v in flat if isinstance(v, torch.Tensor))
        elif obj is not None and hasattr(obj, "state_dict"):
            flat = tree_flatten(obj.state_dict())[0]
            out.extend(v for v in flat if isinstance(v, torch.Tensor))
    return [t for t in out if _has_storage(t)]


@dataclass
class PeakReading:
    """Filled in when :func:`measure_peak`'s block ends."""

    peak_bytes: int = 0
    phases: list[PhaseRecord] = field(default_factory=list)


@contextlib.contextmanager
def measure_peak(
    device: torch.device,
    *,
    existing: Iterable[torch.Tensor] = (),
    budget_bytes: int | None = None,
    context_bytes: int = 0,
    foreign_bytes: int = 0,
    tracker: LiveBytesTracker | None = None,
) -> Iterator[PeakReading]:
    """Measure the peak device memory of the block, by the device's definition.

    Args:
        device: The device the block runs on.
        existing: Tensors alive before the block that count towards the peak (CPU only;
            on CUDA the allocator already holds them).
        budget_bytes: On CPU, the guard raises ``torch.OutOfMemoryError`` past it; on
            CUDA the caching allocator is capped at it for the block.
        context_bytes: CUDA context size, added to the CUDA peak.
        foreign_bytes: CUDA bytes held by tensors that are not part of the measured run.
        tracker: On CPU, a tracker to use (to read its phases); a new one otherwise.
    """
    reading = PeakReading()
    if device.type == "cuda":
        with _cuda_cap(device, budget_bytes, context_bytes, foreign_bytes):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            yield reading
            torch.cuda.synchronize(device)
        reserved = torch.cuda.max_memory_reserved(device)
        reading.peak_bytes = max(reserved - foreign_bytes, 0) + context_bytes
        return
    tracker = tracker or LiveBytesTracker(device.type, budget_bytes=budget_bytes)
    tracker.track(existing)
    tracker.peak = tracker.live
    with tracker:
        yield reading
    tracker.close()
    reading.peak_bytes = tracker.peak
    reading.phases = tracker.phases


@contextlib.contextmanager
def _cuda_cap(
    device: torch.device, budget_bytes: int | None, context_bytes: int, foreign_bytes: int
) -> Iterator[None]:
    """Cap the caching allocator so that reserved + context stays within the budget."""
    if budget_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = budget_bytes - context_bytes + foreign_bytes
    torch.cuda.set_per_process_memory_fraction(min(max(allowed / total, 0.0), 1.0), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
