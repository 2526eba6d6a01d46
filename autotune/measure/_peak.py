"""Peak device memory: one definition per device, used everywhere.

* **CPU**: the peak of live tensor-storage bytes, counted exactly by the
  :class:`~autotune.measure._tracker.LiveBytesTracker`, which also guards the budget.
* **CUDA**: the caching allocator's reserved peak plus the CUDA context, minus what other
  tensors of this process already held when the measurement began.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from autotune.measure._tracker import LiveBytesTracker, PhaseRecord

__all__ = ["PeakReading", "measure_peak"]


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
