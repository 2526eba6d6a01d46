"""The baseline: the expert's recipe (:func:`autotune.cost.expert_candidates`), verified
in every run beside the tuner's own candidates and timed the same way, so that the winner
is never measured slower than what a knowledgeable user writes by hand, and the result
says how it compares."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from autotune.cost import Candidate, Chooser, expert_candidates
from autotune.result import TrialRecord
from autotune.verify._winner import Measure

__all__ = ["baseline_candidates", "baseline_record", "verify_baseline"]

log = logging.getLogger("autotune")


def baseline_candidates(choosers: Sequence[Chooser], device_type: str) -> list[Candidate]:
    """The expert's configs of a run's choosers (the one-process layout's)."""
    return [c for p in choosers for c in expert_candidates(p, device_type)]


def verify_baseline(
    measure: Measure, experts: Sequence[Candidate], tried: Sequence[TrialRecord]
) -> list[TrialRecord]:
    """Run each of ``experts`` not ``tried`` already: their records."""
    done = {r.config for r in tried}
    out = []
    for cand in experts:
        if cand.config in done:
            continue
        log.info("verifying the expert's recipe: %s", cand.config.describe())
        record = measure(cand.config, cand.prediction.measurement)
        if record is not None:
            out.append(record)
            done.add(cand.config)
    return out


def baseline_record(
    records: Sequence[TrialRecord], experts: Sequence[Candidate]
) -> TrialRecord | None:
    """The fastest measured of the expert's configs among ``records`` (their last
    timing), or ``None`` where none fitted."""
    configs = {c.config for c in experts}
    fitted = [r for r in records if r.config in configs and r.measured is not None]
    return max(fitted, key=lambda r: r.measured.samples_per_s if r.measured else 0.0, default=None)
