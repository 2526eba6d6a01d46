"""Peak device memory: one definition per device, used everywhere.

* **CPU**: the peak of live tensor-storage bytes, counted exactly by the
  :class:`~autotune.measure._tracker.LiveBytesTracker`, which also guards the budget.
* **CUDA**: the caching allocator's reserved peak plus the CUDA context, minus what other
  tensors of this process already held when the measurement began.

:func:`peak_memory` is that reading around a user's own training loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autotune.device import backend_for, discover, resolve_device
from autotune.measure._tracker import LiveBytesTracker, PhaseRecord, state_tensors, tracker_for
from autotune.train import Applied, following_gathered, measured_compiling

__all__ = ["PeakReading", "measure_peak", "peak_memory"]


@dataclass
class PeakReading:
    """Filled in when :func:`measure_peak`'s block ends."""

    peak_bytes: int = 0
    """Peak device memory by the device's definition."""
    live_peak_bytes: int = 0
    """Peak live tensor bytes, where a tracker counted them (0 otherwise)."""
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
    gathering: Iterable[nn.Module] = (),
    compiled: bool = False,
) -> Iterator[PeakReading]:
    """Measure the peak device memory of the block, by the device's definition.

    With a caching allocator (CUDA) the peak is its reserved peak, less ``foreign_bytes``,
    plus the context, and the allocator is capped so that this stays within the budget.
    Without one (CPU) it is the tracker's live-bytes peak, and the tracker guards the
    budget. A tracker passed in counts live bytes and phases on every device: the
    profile's timeline is in live bytes everywhere.

    Args:
        device: The device the block runs on.
        existing: Tensors alive before the block that count towards the tracker's peak.
        budget_bytes: The budget the block must stay within (``None``: unbounded).
        context_bytes: Device memory outside the allocator (the CUDA context).
        foreign_bytes: Allocator bytes held by tensors that are not part of the run.
        tracker: A tracker to use (to read its phases); without a caching allocator a
            new one otherwise.
        gathering: Models whose FSDP2 units gather their parameters into storage freed
            and allocated again by resizing, outside any op: the tracker reads those
            storages' sizes at every op, from the unit's first forward on.
        compiled: The block runs compiled blocks (see
            :func:`~autotune.measure._tracker.tracker_for`).
    """
    backend = backend_for(device)
    reading = PeakReading()
    if tracker is None and not backend.caching:
        tracker = tracker_for(compiled, device.type, budget_bytes=budget_bytes)
    if tracker is not None:
        tracker.track(existing)
        tracker.peak = tracker.live
    following = (
        following_gathered(gathering, tracker.watch) if tracker else contextlib.nullcontext()
    )
    cap = None
    if backend.caching and budget_bytes is not None:
        cap = budget_bytes - context_bytes + foreign_bytes
    with backend.cap(cap):
        backend.synchronize()
        backend.reset_peak()
        with following, tracker if tracker is not None else contextlib.nullcontext():
            yield reading
        backend.synchronize()
    if tracker is not None:
        tracker.close()
        reading.phases = tracker.phases
        reading.live_peak_bytes = tracker.peak
    if backend.caching:
        reading.peak_bytes = max(backend.max_reserved() - foreign_bytes, 0) + context_bytes
    else:
        assert tracker is not None
        reading.peak_bytes = tracker.peak


@contextlib.contextmanager
def peak_memory(*holding: Any, device: torch.device | str | None = None) -> Iterator[PeakReading]:
    """Measure the peak device memory of the block; read ``.peak_bytes`` after it.

    >>> with autotune.peak_memory(runner) as reading:
    ...     for batch in loader:
    ...         runner.step(batch)
    >>> reading.peak_bytes <= result.budget_bytes

    Args:
        holding: What already holds device memory when the block begins and counts
            towards its peak on the CPU: a handle from :func:`autotune.prepare` or
            :func:`autotune.apply`, models, optimizers. Tensors made inside the block
            (batches, activations, an optimizer's state) count on their own. On CUDA the
            allocator counts everything the process reserved.
        device: The device to measure; default: a handle's, else CUDA if available.

    On the CPU every op in the block is counted as it runs, which slows small models
    down (up to a few times): measure a few steps, not a whole run. A handle whose
    config compiles blocks runs them compiled, and their buffers count where their code
    is compiled inside the block (its first steps; code compiled before keeps a route
    past the count).
    """
    handles = [h for h in holding if isinstance(h, Applied)]
    if device is None:
        device = handles[0].device if handles else None
    target = resolve_device(device)
    objects = [o for o in holding if not isinstance(o, Applied)]
    for h in handles:
        objects += [h.model, h.optimizer, h.scaler]
    context = discover(target).context_bytes  # the CUDA context; 0 on the CPU
    compiled = any(h.config.compile_level != "none" for h in handles)
    with (
        measured_compiling(compiled),
        measure_peak(
            target,
            existing=state_tensors(*objects),
            context_bytes=context,
            gathering=[o for o in objects if isinstance(o, torch.nn.Module)],
            compiled=compiled,
        ) as reading,
    ):
        yield reading
