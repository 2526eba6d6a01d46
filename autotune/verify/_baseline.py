"""The baseline: the expert's recipe (:func:`autotune.cost.expert_candidates`), verified
in every run beside the tuner's own candidates and timed the same way, so that the winner
is never measured slower than what a knowledgeable user writes by hand, and the result
says how it compares."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from autotune.cost import Chooser, ExpertRecipe, expert_candidates
from autotune.result import TrialRecord
from autotune.verify._winner import Measure, at_most

__all__ = ["baseline_candidates", "baseline_record", "verify_baseline"]

log = logging.getLogger("autotune")


def baseline_candidates(choosers: Sequence[Chooser], device_type: str) -> ExpertRecipe:
    """The expert's configs of a run's choosers (the one-process layout's), and the note
    of the first that has one."""
    recipes = [expert_candidates(p, device_type) for p in choosers]
    ladders = tuple(ladder for r in recipes for ladder in r.ladders)
    notes = [r.note for r in recipes if r.note and (r.ladders or not ladders)]
    return ExpertRecipe(ladders, notes[0] if notes else "")


def verify_baseline(
    measure: Measure, recipe: ExpertRecipe, tried: Sequence[TrialRecord], *, slack: float
) -> tuple[list[TrialRecord], str]:
    """Run each of the recipe's ladders from its largest micro-batch down until a config
    runs, as an expert finds it (a config ``tried`` already is not run again): their
    records, and a note of the ladders not run.

    Each config is held to the tuner's own candidates' rules (see
    :func:`~autotune.verify.choose_winner`): raced against the fastest config measured
    so far (``beat``: one that has lost by more than re-timing could call stops early),
    and not run where its prediction, scaled by the most optimistic calibration of the
    configs ``tried`` (measured over predicted speed) and ``slack`` more, stays below that
    fastest: it cannot beat the winner, and the note says so with both speeds.
    """
    done = {r.config: r for r in tried}
    out = []
    best = max((r.measured.samples_per_s for r in tried if r.measured), default=0.0)
    hopeless = []
    for ladder in recipe.ladders:
        for cand in ladder:
            record = done.get(cand.config)
            if record is None:
                most = at_most(cand.prediction.measurement.samples_per_s, tried, slack)
                if most is not None and most < best:
                    hopeless.append(
                        f"{cand.config.describe()} left out, as it cannot win (predicted at "
                        f"most {most:.1f} samples/s, {best:.1f} measured)"
                    )
                    break
                log.info("verifying the expert's recipe: %s", cand.config.describe())
                record = measure(cand.config, cand.prediction.measurement, beat=best)
                if record is None:  # another process runs it
                    break
                out.append(record)
                done[cand.config] = record
            if record.measured is not None:
                best = max(best, record.measured.samples_per_s)
                break
            log.info("the expert's recipe failed (%s): the next micro-batch down", record.error)
    note = "; ".join(hopeless)
    if note:
        log.info("the expert's recipe: %s", note)
    return out, note


def baseline_record(records: Sequence[TrialRecord], recipe: ExpertRecipe) -> TrialRecord | None:
    """The fastest measured of the expert's configs among ``records`` (their last
    timing), or ``None`` where none was timed: a fallback's peak alone, on a config that
    is also a rung of the recipe, says nothing of its speed."""
    configs = {c.config for ladder in recipe.ladders for c in ladder}
    fitted = [
        r for r in records if r.config in configs and r.measured is not None and not r.peak_only
    ]
    return max(fitted, key=lambda r: r.measured.samples_per_s if r.measured else 0.0, default=None)
