"""``Stopwatch``: where a run's seconds go, stage by stage."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from autotune.result import Spent

__all__ = ["Stopwatch"]


class Stopwatch:
    """The seconds of a run since it was made, and of each of its stages: a stage runs
    from the end of the one before (or the start) to its own end, so that the stages add
    up to the run."""

    def __init__(self) -> None:
        self.started = self._mark = time.perf_counter()
        self._seconds = {"profile": 0.0, "search": 0.0, "verification": 0.0}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the stage ``name`` (``profile``, ``search`` or ``verification``)."""
        try:
            yield
        finally:
            now = time.perf_counter()
            self._seconds[name] += now - self._mark
            self._mark = now

    def spent(self) -> Spent:
        """The seconds of each stage so far."""
        return Spent(**{f"{name}_s": s for name, s in self._seconds.items()})

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started
