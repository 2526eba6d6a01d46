"""Choosing the winner: which candidates to verify, which verified one wins, and timing the
close contenders again so that one noisy timing does not decide.

The seconds a tuning run may spend (``max_tuning_s``): verification runs what can still
change the result while they last, and says what it skipped for them.

Profiling always runs whole (nothing can be decided without it), and so does the first
candidate's verification (a result is verified). Every later run of a config is one the
budget must hold: it starts only where a run as long as the longest so far still ends
within it, so that a run overshoots its budget by less than one verification.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from autotune._format import format_bytes
from autotune.config import TrainConfig
from autotune.cost import Candidate
from autotune.errors import VerificationError
from autotune.result import Measurement, TrialRecord
from autotune.verify import _noise
from autotune.verify._noise import CONFIDENCE, QUIET, Noise, ahead, lead
from autotune.verify._verifier import Verifier

__all__ = [
    "Measure",
    "TimeBudget",
    "at_most",
    "choose_winner",
    "fastest",
    "known_ahead",
    "retime_contenders",
    "speeds",
    "tied_with",
]

log = logging.getLogger("autotune")

_SAME_SPEED = 0.03
"""Predicted throughputs within this fraction are a tie: the smaller peak is verified first."""
_HOPELESS = 0.5
"""A contender whose lead (either way) is under this share of the least lead the last
round of re-timing could call stops racing after a round: more rounds would most likely
call it a tie too, at a round of timings each (seconds on a CPU)."""


class Measure(Protocol):
    """Runs a config for real (or reads its outcome from a study); None: another process
    has it. ``beat``: the best speed measured so far (samples/s; 0: none), which a config
    clearly slower stops being timed at (see :meth:`Verifier.trial`)."""

    def __call__(
        self, config: TrainConfig, predicted: Measurement, /, beat: float = 0.0
    ) -> TrialRecord | None: ...


def choose_winner(
    measure: Measure,
    candidates: list[Candidate],
    *,
    top: int,
    slack: float = QUIET.slack,
    budget: TimeBudget | None = None,
) -> list[TrialRecord]:
    """Run distinct good candidates until ``top`` of them fit (or ``3 * top`` ran).

    Candidates are taken fastest predicted first, except that predictions within 3% of
    each other count as a tie won by the smaller predicted peak; and a candidate too like
    one that fitted (same layout, precision, optimizer and checkpointing, a micro-batch within a
    factor of 1.5) is skipped, so that verification tests different ideas. A candidate
    like one that was rejected is run: it is that idea's more frugal sibling.

    Verification skips what cannot win: each fitted candidate calibrates the time model
    (measured / predicted speed); once two have, a candidate whose prediction, scaled by
    the most optimistic calibration so far and ``slack`` more (15% on a quiet machine),
    stays below the best measured speed is not run.

    The plainest candidate (nothing wrapped, fp32, the fastest predicted such) is run too
    where no plain config fitted and it could still win: a config with more parts must beat
    it by more than the noise to win, and the same inputs then give the same winner even
    where the profile's timings move the others' ranking from run to run.

    With a ``budget`` (``max_tuning_s``), a candidate after the first that fits runs only
    where the budget allows it.

    Returns:
        The verification records, rejected ones included; the caller picks the winner.
    """
    budget = budget or TimeBudget()
    race = _Race(measure, slack)

    def allowed() -> bool:
        return not race.fitted or budget.allows(f"candidates after the {len(race.records)} run")

    for cand in _tie_frugal(candidates):
        if len(race.fitted) >= top or len(race.records) >= 3 * top or not allowed():
            break
        race.attempt(cand)
    plainest = next((c for c in candidates if _plain(c.config)), None)
    if plainest is not None and not any(_plain(f) for f in race.fitted) and allowed():
        race.attempt(plainest)
    if race.hopeless:
        log.info(
            "not verified: %d candidates that could not beat %.1f samples/s",
            race.hopeless,
            race.best,
        )
    return race.records


def at_most(predicted: float, records: Sequence[TrialRecord], slack: float) -> float | None:
    """The most a config predicted at ``predicted`` samples/s can measure, as the timed
    ``records`` bear the time model out: scaled by their most optimistic calibration
    (measured over predicted speed) and ``slack`` more. ``None`` until two were timed."""
    calibration = [
        r.measured.samples_per_s / max(r.predicted.samples_per_s, 1e-9)
        for r in records
        if r.measured is not None and not r.peak_only
    ]
    if len(calibration) < 2:
        return None
    return predicted * max(calibration) * (1 + slack)


@dataclasses.dataclass
class _Race:
    """The candidates verified so far, and what they say of the rest."""

    measure: Measure
    slack: float
    records: list[TrialRecord] = dataclasses.field(default_factory=list)
    fitted: list[TrainConfig] = dataclasses.field(default_factory=list)
    tried: set[TrainConfig] = dataclasses.field(default_factory=set)
    best: float = 0.0
    hopeless: int = 0

    def attempt(self, cand: Candidate) -> None:
        """Verify ``cand``, unless it is too like one that fitted, or cannot win."""
        if any(_alike(cand.config, f) for f in self.fitted) or cand.config in self.tried:
            return
        most = at_most(cand.prediction.measurement.samples_per_s, self.records, self.slack)
        if most is not None and most < self.best:
            self.hopeless += 1  # it cannot beat what was measured
            return
        log.info("verifying %s", cand.config.describe())
        self.tried.add(cand.config)
        record = self.measure(cand.config, cand.prediction.measurement, beat=self.best)
        if record is None:
            log.info("  another process is verifying it")
            return
        self.records.append(record)
        if record.measured is None:
            log.info("  rejected: %s", record.error)
            return
        self.fitted.append(cand.config)
        self.best = max(self.best, record.measured.samples_per_s)
        log.info(
            "  measured %.1f samples/s, peak %s",
            record.measured.samples_per_s,
            format_bytes(record.measured.peak_bytes),
        )


def _plain(c: TrainConfig) -> bool:
    """Nothing wrapped, offloaded or compiled, in fp32: the simplest way to train."""
    return _simplicity_of(c)[:2] == (0, 0)


def _tie_frugal(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first; within 3% of the fastest, the smallest predicted peak first."""
    if not candidates:
        return []
    best = max(c.prediction.measurement.samples_per_s for c in candidates)
    tied = [
        c for c in candidates if c.prediction.measurement.samples_per_s >= (1 - _SAME_SPEED) * best
    ]
    rest = [c for c in candidates if c not in tied]
    tied.sort(key=lambda c: c.prediction.measurement.peak_bytes)
    return tied + rest


def _alike(a: TrainConfig, b: TrainConfig) -> bool:
    """Too like each other to verify both: the same layout (data parallelism, units kept
    gathered), precision and compilation, optimizer and checkpointing, micro-batches within
    a factor of 1.5."""

    def idea(c: TrainConfig) -> tuple[object, ...]:
        wrapped = (bool(c.checkpoint), bool(c.selective_checkpoint))
        return (c.parallel, bool(c.keep_gathered), c.timeline, c.optimizer, wrapped)

    small, large = sorted((a.micro_batch_size, b.micro_batch_size))
    return idea(a) == idea(b) and large < 1.5 * small


def fastest(records: list[TrialRecord], machine: Noise = QUIET) -> TrialRecord:
    """The record with the highest measured throughput; among those it is not known to
    beat (:func:`known_ahead`, by more than the run-to-run drift), the simplest (fewest
    wrapped or offloaded blocks, then fp32 before mixed precision, then the least
    accumulation, then the smallest peak).

    Raises:
        VerificationError: no configuration fitted.
    """
    passed = [r for r in records if r.measured is not None]
    if not passed:
        raise VerificationError(
            "no candidate configuration ran within the budget on the device; "
            "raise the budget a little or narrow the search space.",
            attempts=tuple(f"{r.config.describe()}: {r.error}" for r in records),
        )
    best, tied, sigma = _ties(passed, machine)
    chosen = min(tied, key=_simplicity)
    if chosen is not best:
        log.info(
            "%s is within the timing noise of the fastest (%s, %.1f%% ahead, noise %.1f%% "
            "per timing): the simpler config wins",
            chosen.config.describe(),
            best.config.describe(),
            100 * math.expm1(lead(speeds(best), speeds(chosen))),
            100 * sigma,
        )
    return chosen


def tied_with(
    chosen: TrialRecord, records: list[TrialRecord], machine: Noise = QUIET
) -> tuple[list[TrainConfig], float]:
    """The configs of ``records`` that ``chosen`` (the winner of :func:`fastest`) is tied
    with: the fastest is not known to be ahead of them (nor of ``chosen``); and the noise
    of one timing that decided it."""
    passed = [r for r in records if r.measured is not None]
    if not passed:
        return [], 0.0
    _, tied, sigma = _ties(passed, machine)
    return [r.config for r in tied if r.config != chosen.config], sigma


def _ties(
    passed: list[TrialRecord], machine: Noise
) -> tuple[TrialRecord, list[TrialRecord], float]:
    """The fastest of ``passed``, those it is not known to be ahead of (itself among them),
    and the noise of one timing."""
    best = max(passed, key=_measured_speed)
    sigma = _noise.noise([speeds(r) for r in passed], machine)
    return best, [r for r in passed if not known_ahead(best, r, sigma, machine.drift)], sigma


def known_ahead(a: TrialRecord, b: TrialRecord, sigma: float, drift: float = 0.0) -> bool:
    """Whether ``a`` is faster than ``b`` with 95% confidence, given the relative noise
    ``sigma`` of one timing: its lead, round by round where both were re-timed, exceeds
    1.645 standard errors; and its median speed is ahead by more than ``drift`` (what one
    config's speed moves against another's from run to run). A smaller lead is a tie."""
    if not ahead(speeds(a), speeds(b), sigma):
        return False
    return _measured_speed(a) > (1 + drift) * _measured_speed(b)


def speeds(r: TrialRecord) -> list[float]:
    """The samples per second of each timing of ``r`` (verification first, then each
    round of re-timing), or its one measured speed."""
    if r.timings:
        return [r.config.global_batch_size / t for t in r.timings]
    return [_measured_speed(r)]


def _measured_speed(r: TrialRecord) -> float:
    return r.measured.samples_per_s if r.measured is not None else 0.0


def _simplicity(r: TrialRecord) -> tuple[int, int, int, int]:
    return (*_simplicity_of(r.config), r.measured.peak_bytes if r.measured else 0)


def _simplicity_of(c: TrainConfig) -> tuple[int, int, int]:
    """Wrapped or offloaded blocks, mixed precision, accumulation: fewer is simpler."""
    wrapped = (
        len(c.checkpoint)
        + len(c.selective_checkpoint)
        + len(c.offload_activations)
        + int(c.offload_optimizer)
        + int(c.compile_level != "none")  # tied with eager code: no compiling
    )
    mixed = int(c.precision != "fp32")  # tied with fp32: no autocast, no loss scaling
    return wrapped, mixed, c.grad_accum_steps


def retime_contenders(
    verifier: Verifier, records: list[TrialRecord], machine: Noise = QUIET
) -> list[TrialRecord]:
    """Time the contenders again, interleaved, until their order is known or they tie.

    One timing per candidate is at the mercy of whatever else the machine does for those
    seconds. A contender the leader is not known to beat (:func:`known_ahead`, at the
    noise assumed before any re-timing) races it: both are timed again, one after the
    other, up to ``machine.rounds`` more times (``machine``: the machine's noise, quiet or
    busy), so that a slow spell hits a round's timings alike
    and comparing them round by round takes it out. After each round the noise is
    estimated from the rounds, the leader is the best median, and a contender whose order
    against it is now known stops, and so does one whose lead is too small for the last
    round to call (:data:`_HOPELESS`). One still racing after the last round, or stopped
    so, is a tie, which :func:`fastest` gives to the simpler config. Each record keeps the
    median of its timings; the figures that decide are logged.
    """
    passed = [r for r in records if r.measured is not None]
    if len(passed) < 2:
        return records
    times = {r.config: [r.measured.step_s] for r in passed if r.measured}

    def rate(c: TrainConfig) -> list[float]:
        return [c.global_batch_size / t for t in times[c]]

    def median(c: TrainConfig) -> float:
        return statistics.median(rate(c))

    leader = max(times, key=median)
    sigma, rounds = machine.prior, machine.rounds
    racing = [c for c in times if c != leader and not ahead(rate(leader), rate(c), sigma)]
    tied: list[TrainConfig] = []
    for done in range(1, rounds + 1):
        if not racing:
            break
        for c in (leader, *racing):
            times[c].append(verifier.retime(c))
        sigma = _noise.noise([rate(c) for c in times], machine)
        timed = (leader, *racing)
        leader = max(timed, key=median)
        racing = [c for c in timed if c != leader and not ahead(rate(leader), rate(c), sigma)]
        if done < rounds:  # a lead the last round could not call stops racing now, a tie
            last = CONFIDENCE * sigma * math.sqrt(2 / (rounds + 1))
            hopeless = [c for c in racing if abs(lead(rate(leader), rate(c))) < _HOPELESS * last]
            racing = [c for c in racing if c not in hopeless]
            tied += hopeless
    for c, ts in times.items():
        if len(ts) >= 2:
            log.info("re-timed %s: %.1f samples/s (median of %d)", c.describe(), median(c), len(ts))
    if racing or tied:
        log.info(
            "tied within the timing noise (%.1f%% per timing) after %d rounds: %s",
            100 * sigma,
            max(len(ts) for ts in times.values()) - 1,
            "; ".join(c.describe() for c in (leader, *racing, *tied)),
        )
    out = []
    for r in records:
        ts = times.get(r.config, [])
        if len(ts) >= 2 and r.measured is not None:
            step = statistics.median(ts)
            n = r.config.global_batch_size
            measured = dataclasses.replace(r.measured, step_s=step, samples_per_s=n / step)
            r = dataclasses.replace(r, measured=measured, timings=tuple(ts))
        out.append(r)
    return out


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
