"""Choosing the winner: which candidates to verify, which verified one wins, and timing the
close contenders again so that one noisy timing does not decide.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable

from autotune._format import format_bytes
from autotune.config import TrainConfig
from autotune.errors import VerificationError
from autotune.plan._planner import Candidate
from autotune.result import Measurement, TrialRecord
from autotune.verify._verifier import Verifier

__all__ = ["Measure", "choose_winner", "fastest", "noise", "settle"]

log = logging.getLogger("autotune")

_SAME_SPEED = 0.03
"""Predicted throughputs within this fraction are a tie: the smaller peak is verified first."""
_SAME_MEASURED = 0.01
"""The least timing noise: measured throughputs within it are a tie, won by the simpler
config. Kept small: every point of it is speed given up."""
_MOST_NOISE = 0.03
"""The most timing noise a tie may span, however noisy the re-timings were."""

_MODEL_SLACK = 0.15
"""How much better than its most optimistic calibration a candidate's speed may still turn
out: the time model's error differs from config to config by up to about this much."""

_BEHIND = 0.07
"""A contender this far behind the leader's median after a round of re-timing is settled."""

Measure = Callable[[TrainConfig, Measurement], "TrialRecord | None"]
"""Runs a config for real (or reads its outcome from a study); None: another process has it."""


def choose_winner(measure: Measure, candidates: list[Candidate], *, top: int) -> list[TrialRecord]:
    """Run distinct good candidates until ``top`` of them fit (or ``3 * top`` ran).

    Candidates are taken fastest predicted first, except that predictions within 3% of
    each other count as a tie won by the smaller predicted peak; and a candidate too like
    one that fitted (same layout, precision, optimizer and checkpointing, a micro-batch within a
    factor of 1.5) is skipped, so that verification tests different ideas. A candidate
    like one that was rejected is run: it is that idea's more frugal sibling.

    Verification skips what cannot win: each fitted candidate calibrates the time model
    (measured / predicted speed); once two have, a candidate whose prediction, scaled by
    the most optimistic calibration so far and 15% more, stays below the best measured
    speed is not run.

    Returns:
        The verification records, rejected ones included; the caller picks the winner.
    """
    records: list[TrialRecord] = []
    fitted: list[TrainConfig] = []
    calibration: list[float] = []  # measured / predicted speed of each fitted candidate
    best, hopeless = 0.0, 0
    for cand in _tie_frugal(candidates):
        if len(fitted) >= top or len(records) >= 3 * top:
            break
        if any(_alike(cand.config, f) for f in fitted):
            continue
        predicted = cand.prediction.measurement.samples_per_s
        if len(calibration) >= 2 and predicted * max(calibration) * (1 + _MODEL_SLACK) < best:
            hopeless += 1  # it cannot beat what was measured
            continue
        log.info("verifying %s", cand.config.describe())
        record = measure(cand.config, cand.prediction.measurement)
        if record is None:
            log.info("  another process is verifying it")
            continue
        records.append(record)
        if record.measured is None:
            log.info("  rejected: %s", record.error)
            continue
        fitted.append(cand.config)
        calibration.append(record.measured.samples_per_s / max(predicted, 1e-9))
        best = max(best, record.measured.samples_per_s)
        log.info(
            "  measured %.1f samples/s, peak %s",
            record.measured.samples_per_s,
            format_bytes(record.measured.peak_bytes),
        )
    if hopeless:
        log.info("not verified: %d candidates that could not beat %.1f samples/s", hopeless, best)
    return records


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
    gathered), precision, optimizer and checkpointing, micro-batches within a factor of 1.5."""

    def idea(c: TrainConfig) -> tuple[object, ...]:
        return (c.parallel, bool(c.keep_gathered), c.precision, c.optimizer, bool(c.checkpoint))

    small, large = sorted((a.micro_batch_size, b.micro_batch_size))
    return idea(a) == idea(b) and large < 1.5 * small


def fastest(records: list[TrialRecord]) -> TrialRecord:
    """The record with the highest measured throughput; among those within the timing
    noise of it, the simplest (fewest checkpointed or offloaded blocks, then the least
    accumulation, then the smallest peak).

    The noise is what the re-timings showed: the median half-spread of the re-timed
    records' timings relative to their median, kept between 1% and 3%.

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
    best = max(r.measured.samples_per_s for r in passed if r.measured is not None)
    tie = noise(passed)
    tied = [r for r in passed if r.measured and r.measured.samples_per_s >= (1 - tie) * best]
    return min(tied, key=_simplicity)


def noise(records: list[TrialRecord]) -> float:
    """The timing noise the re-timed ``records`` showed (1% to 3%; 1% without re-timings)."""
    spreads = [
        (max(r.timings) - min(r.timings)) / 2 / statistics.median(r.timings)
        for r in records
        if len(r.timings) >= 2
    ]
    if not spreads:
        return _SAME_MEASURED
    return min(max(statistics.median(spreads), _SAME_MEASURED), _MOST_NOISE)


def _simplicity(r: TrialRecord) -> tuple[int, int, int]:
    c = r.config
    wrapped = len(c.checkpoint) + len(c.offload_activations) + int(c.offload_optimizer)
    return wrapped, c.grad_accum_steps, r.measured.peak_bytes if r.measured else 0


def settle(verifier: Verifier, records: list[TrialRecord], *, rounds: int = 2) -> list[TrialRecord]:
    """Time the close contenders again, interleaved, and keep the median of all timings.

    One timing per candidate is at the mercy of whatever else the machine does for those
    seconds; contenders within 15% of the fastest run up to ``rounds`` more times,
    alternating, so that a slow spell hits them alike. After a round, a contender whose
    median is more than 7% behind the leader's is settled (it cannot catch up within the
    noise) and is not timed again. The figures that decide are logged.
    """
    passed = [r for r in records if r.measured is not None]
    if len(passed) < 2:
        return records
    best = max(r.measured.samples_per_s for r in passed if r.measured)
    close = [r for r in passed if r.measured and r.measured.samples_per_s >= 0.85 * best]
    if len(close) < 2:
        return records
    times = {r.config: [r.measured.step_s] for r in close if r.measured}
    racing = [r.config for r in close]
    for _ in range(rounds):
        if len(racing) < 2:
            break
        for c in racing:
            times[c].append(verifier.retime(c))
        lead = max(_speed(c, times[c]) for c in racing)
        racing = [c for c in racing if _speed(c, times[c]) >= (1 - _BEHIND) * lead]
    for c, ts in times.items():
        speed = _speed(c, ts)
        log.info("re-timed %s: %.1f samples/s (median of %d)", c.describe(), speed, len(ts))
    out = []
    for r in records:
        if r.config in times and r.measured is not None:
            step = statistics.median(times[r.config])
            n = r.config.effective_batch_size
            measured = dataclasses.replace(r.measured, step_s=step, samples_per_s=n / step)
            r = dataclasses.replace(r, measured=measured, timings=tuple(times[r.config]))
        out.append(r)
    return out


def _speed(config: TrainConfig, step_times: list[float]) -> float:
    """Samples per second at the median of ``step_times``."""
    return config.effective_batch_size / statistics.median(step_times)
