"""What the in-trainer benchmark's arms share: the data, the budget guard, the step clock.

* :class:`Rows`: a case's sample batch as a dataset of single samples, which the trainers'
  own dataloaders batch again (a Mapping stays a Mapping, a tuple comes back a list).
* :class:`Guard`: the CPU budget guard (:class:`~autotune.measure._tracker.LiveBytesTracker`)
  for a batch-size finder. It is armed when a step begins and disarmed when it ends or
  raises, so that what the finder does between trials (Lightning restores a checkpoint
  after its search) is not cut short by an error the finder would not expect there.
* :class:`Clock`: the time at the end of every optimizer step; throughput is the global
  batch times the timed steps over the time from the end of the warm-up to the last.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch.utils.data import Dataset

from autotune.measure._peak import measure_peak
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.train._batch import batch_size, map_tensors

__all__ = ["TIMED", "WARMUP", "Clock", "Guard", "Rows"]

WARMUP = 2
"""Optimizer steps before the clock starts (allocator and autocast caches warm)."""
TIMED = 6
"""Optimizer steps timed."""


class Rows(Dataset[Any]):
    """The samples of one batch, one at a time."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.n = batch_size(batch)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return map_tensors(self.batch, lambda t: t[i])


class _Disarming(LiveBytesTracker):
    """A budget guard that disarms itself when it raises."""

    def _grow(self, nbytes: int, *, check_budget: bool) -> None:
        try:
            super()._grow(nbytes, check_budget=check_budget)
        except torch.OutOfMemoryError:
            self.budget_bytes = None
            raise


class Guard:
    """The budget guard around a batch-size finder's trials on the CPU."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.tracker = _Disarming("cpu")
        self._stack = contextlib.ExitStack()

    def start(self, *state: Any) -> None:
        """Count live bytes from now on, ``state`` (model, optimizers) included."""
        existing = state_tensors(*state)
        self._stack.enter_context(
            measure_peak(torch.device("cpu"), existing=existing, tracker=self.tracker)
        )

    def arm(self) -> None:
        """A step begins: from here the budget holds (until the next OOM)."""
        self.tracker.budget_bytes = self.budget_bytes

    def disarm(self) -> None:
        """The step ended: what follows until the next is the finder's bookkeeping."""
        self.tracker.budget_bytes = None

    def stop(self) -> None:
        """Stop counting (idempotent)."""
        self._stack.close()


class Clock:
    """Times of the ends of optimizer steps."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def tick(self) -> None:
        self.ends.append(time.perf_counter())

    def samples_per_s(self, global_batch: int) -> float:
        """Throughput over the timed steps."""
        if len(self.ends) < WARMUP + TIMED:
            raise RuntimeError(f"only {len(self.ends)} optimizer steps ran")
        seconds = self.ends[WARMUP + TIMED - 1] - self.ends[WARMUP - 1]
        return global_batch * TIMED / seconds
