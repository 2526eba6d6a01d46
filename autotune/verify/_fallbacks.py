"""The fallback ladder: verified configurations to fall back to when training runs out of
memory, fastest first, each with a smaller measured peak than the one before.
"""

from __future__ import annotations

import logging

from autotune.config import TrainConfig
from autotune.cost import Chooser, fallback_candidates
from autotune.result import TrialRecord
from autotune.verify._winner import Measure

__all__ = ["fallback_ladder"]

log = logging.getLogger("autotune")


def fallback_ladder(
    measure: Measure, chooser: Chooser, winner: TrialRecord, records: list[TrialRecord]
) -> list[TrainConfig]:
    """Verified configs with the winner's effective batch and optimizer, fastest first,
    each with a lower measured peak than the one before.

    Besides the candidates already verified, two more are run: the fastest predicted
    config at 3/4 of the winner's peak, and the most frugal one (the smallest micro-batch
    with at most 64 accumulation steps, every block checkpointed, the precision that
    needs least); each only if no verified config goes as low as it is predicted to.
    ``measure`` runs them for their peak alone (``peak_only``: two micro-batches a
    step). ``records`` gains their trials. The ladder is ordered by predicted speed, the
    one figure every rung has.
    """
    config = winner.config
    assert winner.measured is not None

    def same(rs: list[TrialRecord]) -> list[TrialRecord]:
        return [
            r
            for r in rs
            if r.measured is not None
            and r.config != config
            and r.config.effective_batch_size == config.effective_batch_size
            and config.can_switch_to(r.config)
        ]

    for cand in fallback_candidates(chooser, config, winner.measured.peak_bytes):
        low = cand.prediction.measurement.peak_bytes
        if any(r.config == cand.config for r in records) or any(
            r.measured is not None and r.measured.peak_bytes <= low for r in same(records)
        ):
            continue  # verified already, or a verified one goes as low
        log.info("verifying fallback %s", cand.config.describe())
        if (record := measure(cand.config, cand.prediction.measurement)) is not None:
            records.append(record)
    ladder = same(records)
    ladder.sort(key=lambda r: -r.predicted.samples_per_s)
    out: list[TrainConfig] = []
    last = winner.measured.peak_bytes
    for r in ladder:
        assert r.measured is not None
        if r.measured.peak_bytes < last:
            out.append(r.config)
            last = r.measured.peak_bytes
    return out
