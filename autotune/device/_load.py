"""What other work took of the machine's CPUs while a run measured.

Timings taken while other processes compete for the cores scatter, and torch's OpenMP
threads, which spin while they wait, make it worse (a 2-core machine shared with other
jobs tuned 7.8x slower with them spinning). A tuning run reads the machine's CPU time
(``/proc/stat``: every core's busy time, stolen time included) and its own
(``os.times``) when it starts and ends; the difference is what others used, in cores.
Where ``/proc/stat`` is missing (not Linux), nothing is said.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["CpuClock", "busy", "busy_note"]

_BUSY_SHARE = 0.5
"""Others using this share of the cores this process may run on make the machine busy."""


@dataclass(frozen=True)
class CpuClock:
    """The machine's busy CPU seconds, this process's, and the wall clock, at one moment."""

    machine_s: float
    own_s: float
    wall_s: float

    @staticmethod
    def now() -> CpuClock | None:
        """The clock now (``None`` where the machine's CPU time cannot be read)."""
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu" or len(fields) < 9:
            return None
        # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
        ticks = [int(x) for x in fields[1:9]]
        working = sum(ticks) - ticks[3] - ticks[4]
        own = os.times()
        return CpuClock(working / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic())

    def others_since(self, start: CpuClock) -> float:
        """Cores other processes kept busy on average since ``start``."""
        wall = max(self.wall_s - start.wall_s, 1e-9)
        others = (self.machine_s - start.machine_s) - (self.own_s - start.own_s)
        return max(others, 0.0) / wall


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def busy(others: float | None) -> bool:
    """Whether other processes keeping ``others`` cores busy make the machine busy."""
    return others is not None and others >= _BUSY_SHARE * usable_cores()


def busy_note(others: float | None, scattered: float | None) -> str | None:
    """Why the machine counts as busy, and what to do; ``None`` where it does not.

    Args:
        others: Cores other processes kept busy while tuning (``None``: not known).
        scattered: The noise of one timing where it reached the most assumed (else
            ``None``).
    """
    cores = usable_cores()
    why = []
    if busy(others):
        why.append(f"other processes kept {others:.1f} of its {cores} cores busy")
    if scattered is not None:
        why.append(f"timings scattered by {100 * scattered:.0f}% or more each")
    if not why:
        return None
    advice = "tune when it is idle for a surer winner"
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        advice = (
            "set OMP_WAIT_POLICY=PASSIVE before Python starts (the autotune command does), "
            "so that torch's threads do not spin against the other work, or " + advice
        )
    return f"the machine was busy while tuning ({'; '.join(why)}): {advice}."
