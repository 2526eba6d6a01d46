"""One timing harness for every arm a benchmark compares: the tuned config through
autotune's runner, the expert's loop, the grid's configs.

Each arm gets the same treatment: its batch already on the device, two warm-up steps
(the optimizer's state made, the compiler done), then timed steps each ended by a
synchronisation, nothing else running in the process (no memory meter, no NVML thread:
sample those while tuning, never while timing). The median is the arm's step time; the
spread (the interquartile range over the median) says how far one timing can be trusted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import autotune
from autotune.device import backend_for
from autotune.train import map_tensors

__all__ = ["Timing", "time_runner", "time_steps"]

WARMUP = 2
STEPS = 5


@dataclass(frozen=True)
class Timing:
    """An arm's step time: the median of its timed steps, and their spread."""

    step_s: float
    spread: float
    """Interquartile range over the median (0 with fewer than four steps)."""
    steps: int

    def samples_per_s(self, samples: int) -> float:
        return samples / self.step_s


def time_steps(
    step: Callable[[], Any], device: torch.device, steps: int = STEPS, *, warmup: int = WARMUP
) -> Timing:
    """Time ``step`` (one optimizer step) after ``warmup`` untimed ones."""
    backend = backend_for(device)
    for _ in range(warmup):
        step()
    backend.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        backend.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    spread = 0.0
    if len(times) >= 4:
        q = statistics.quantiles(times, n=4)
        spread = (q[2] - q[0]) / median
    return Timing(median, spread, steps)


def time_runner(
    model: nn.Module,
    result: autotune.TuneResult,
    batch: Any,
    device: torch.device,
    steps: int = STEPS,
) -> Timing:
    """The tuned config of ``result`` through autotune's runner on ``model`` (trained in
    place), one step over ``batch`` (moved to the device first, as the expert's is)."""
    on_device = map_tensors(batch, lambda t: t.to(device))
    with autotune.prepare(model, result, lr=1e-5, device=device) as runner:
        return time_steps(lambda: runner.step(on_device), device, steps)
