"""When is one configuration faster than another? Timings, their noise, a lead known.

Each configuration in a race is timed once when verified and again in every round of
re-timing it takes part in, the contenders of a round one after the other. A slow spell
of the machine (another process, a frequency change) slows every timing of its round
alike; comparing two configurations round by round takes it out. What is left, the
noise of one timing, is estimated from the rounds themselves (pooled with an assumed 3%
that counts as two rounds, so that a lucky pair of rounds does not pass for a quiet
machine), and a lead counts only once it exceeds 1.645 standard errors of that noise
(one-sided 95% confidence): a smaller one is a tie, and ties go to the simpler
configuration.

Speeds are compared in logs (ratios), each configuration's list of speeds in the order
of its timings: index 0 its verification, index ``k`` round ``k``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BUSY",
    "CONFIDENCE",
    "LEAST_NOISE",
    "MOST_NOISE",
    "PRIOR_NOISE",
    "PRIOR_WEIGHT",
    "QUIET",
    "Noise",
    "ahead",
    "lead",
    "noise",
]

LEAST_NOISE = 0.01
"""The least relative noise of one timing assumed: leads smaller than a few times it are
ties. Kept small: every point of a tie is speed given up for simplicity."""
MOST_NOISE = 0.04
"""The most relative noise of one timing assumed, however noisy the timings were: the
widest a tie may grow."""
PRIOR_NOISE = 0.03
"""The noise of one timing assumed before any configuration was timed twice: a lead of
up to 1.645 * 3% * sqrt(2) = 7% after one timing each is raced."""
PRIOR_WEIGHT = 2
"""Degrees of freedom the assumed noise counts for beside the measured ones: two rounds
whose ratios happened to agree say little about the noise, and would otherwise make a
lead of a few percent look certain on a machine whose timings scatter by five."""
CONFIDENCE = 1.645
"""Standard errors a lead must exceed: one-sided 95% confidence that it is real."""


@dataclass(frozen=True)
class Noise:
    """What a machine's timings are assumed to scatter by before they are measured, the
    most they may, and how many rounds of re-timing a race gets."""

    prior: float = PRIOR_NOISE
    most: float = MOST_NOISE
    rounds: int = 2
    drift: float = 0.03
    """How far a config's speed may move from one tuning run to the next on this machine
    (another process's memory layout, clocks, caches: what the rounds of one run share,
    so no pairing takes it out): a winner's lead smaller than it is a tie, so that the
    same inputs give the same winner, or one the result lists as tied with it."""
    slack: float = 0.15
    """How much better than its most optimistic calibration a candidate's speed may turn
    out: the time model's error from config to config, larger where the profile's
    timings were taken beside other work."""


QUIET = Noise()
"""An idle machine."""
BUSY = Noise(prior=0.10, most=0.15, rounds=3, drift=0.10, slack=0.5)
"""A machine other work shares (see :func:`autotune.device.busy_note`): a config timed
while the others ran and one timed while they paused differ by tens of percent, so every
contender within 23% races, a round more, and its lead counts only paired round by round."""


def lead(a: Sequence[float], b: Sequence[float]) -> float:
    """How far speeds ``a`` are ahead of ``b``, in logs: the mean of their ratios round by
    round where both were re-timed, else the ratio of their medians."""
    if len(a) >= 2 and len(b) >= 2:
        n = min(len(a), len(b))
        return statistics.fmean(math.log(a[i] / b[i]) for i in range(n))
    return math.log(statistics.median(a) / statistics.median(b))


def ahead(a: Sequence[float], b: Sequence[float], sigma: float) -> bool:
    """Whether speeds ``a`` are ahead of ``b`` with 95% confidence, given the relative
    noise ``sigma`` of one timing."""
    if min(a) <= 0 or min(b) <= 0:
        return statistics.median(a) > statistics.median(b)
    if len(a) >= 2 and len(b) >= 2:  # paired round by round: the mean of n differences
        error = sigma * math.sqrt(2 / min(len(a), len(b)))
    else:
        error = sigma * math.sqrt(1 / len(a) + 1 / len(b))
    return lead(a, b) > CONFIDENCE * error


def noise(raced: Sequence[Sequence[float]], machine: Noise = QUIET) -> float:
    """The relative noise of one timing, from the configurations timed more than once.

    Each is compared round by round with the one timed most often (the leader, in every
    round): the spread of those log ratios about their mean is twice the variance of one
    timing, with what a round's timings share taken out. One configuration timed alone
    gives its own spread. The measured variance is pooled with the noise assumed (3% on
    a quiet machine), weighted as :data:`PRIOR_WEIGHT` degrees of freedom, and kept
    between 1% and the most assumed (4% on a quiet machine).
    """
    runs = [list(r) for r in raced if len(r) >= 2]
    squares, freedom = 0.0, 0
    if runs:
        reference = max(runs, key=len)
        others = [r for r in runs if r is not reference]
        if others:
            n = len(reference)
            logs = [[math.log(r[i] / reference[i]) for i in range(min(len(r), n))] for r in others]
            squares, freedom = _spread(logs)
            squares /= 2  # a ratio of two timings: twice the variance of one
        else:
            squares, freedom = _spread([[math.log(x) for x in reference]])
    variance = (squares + PRIOR_WEIGHT * machine.prior**2) / (freedom + PRIOR_WEIGHT)
    return min(max(math.sqrt(variance), LEAST_NOISE), machine.most)


def _spread(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The squared deviations of values about their group's mean, summed over the groups,
    and their degrees of freedom."""
    squares, freedom = 0.0, 0
    for values in groups:
        if len(values) < 2:
            continue
        mean = statistics.fmean(values)
        squares += sum((x - mean) ** 2 for x in values)
        freedom += len(values) - 1
    return squares, freedom
