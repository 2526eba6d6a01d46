"""The seconds a tuning run may spend (``max_tuning_s``): verification runs what can still
change the result while they last, and says what it skipped for them.

Profiling always runs whole (nothing can be decided without it), and so does the first
candidate's verification (a result is verified). Every later run of a config is one the
budget must hold: it starts only where a run as long as the longest so far still ends
within it, so that a run overshoots its budget by less than one verification.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["TimeBudget"]

log = logging.getLogger("autotune")

T = TypeVar("T")


class TimeBudget:
    """What is left of a run's seconds.

    Args:
        ends: When the run must end (``time.perf_counter()``'s clock); ``None``: no
            budget, every run allowed.
    """

    def __init__(self, ends: float | None = None) -> None:
        self.ends = ends
        self.longest = 0.0
        """The longest run of a config so far, in seconds: what the next one may take."""
        self.skipped: list[str] = []
        """What was not done for the budget, in the order skipped."""

    def allows(self, what: str) -> bool:
        """Whether a run as long as the longest so far still ends within the budget; where
        it does not, ``what`` is recorded as skipped (and logged)."""
        if self.ends is None or time.perf_counter() + self.longest <= self.ends:
            return True
        self.skip(what)
        return False

    def skip(self, what: str) -> None:
        """Record ``what`` as not done for the budget (once)."""
        if what not in self.skipped:
            self.skipped.append(what)
            log.info("max_tuning_s spent: %s not done", what)

    def timed(self, run: Callable[[], T]) -> T:
        """``run()``, its seconds counted in :attr:`longest`."""
        started = time.perf_counter()
        try:
            return run()
        finally:
            self.longest = max(self.longest, time.perf_counter() - started)
