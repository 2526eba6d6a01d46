"""A tuning run's verification, top to bottom: the plan's config first, the best
candidates, the expert's recipe, the contenders timed again, the winner, its fallback
ladder and their evaluation batches.

Each run of a config is a job done once among the processes that share the run's jobs (a
kept study's, a process group's), and so is each reading of the machine's load: a run
that resumes a study (or another process of it) decides as the first did, so it verifies
and re-times the same configs, reading their results instead of measuring again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autotune._plain_data import from_plain, to_plain
from autotune.config import TrainConfig
from autotune.cost import Candidate, Chooser, chooser_of
from autotune.device import CpuClock, busy
from autotune.jobs import Codec, JobStore, job_key
from autotune.result import Measurement, TrialRecord, TuneResult
from autotune.train import agree_max
from autotune.verify._baseline import baseline_candidates, baseline_record, verify_baseline
from autotune.verify._fallbacks import fallback_ladder
from autotune.verify._noise import BUSY, QUIET, Noise
from autotune.verify._time_budget import TimeBudget
from autotune.verify._verifier import Verifier, with_eval_batches
from autotune.verify._winner import Measure, choose_winner, fastest, settle, tied_with

__all__ = ["VERIFY_TOP", "Verification", "verification"]

log = logging.getLogger("autotune")

VERIFY_TOP = 3
"""Candidates verified for real, fastest predicted first (more where the first fail)."""

_RECORD = Codec(to_plain, functools.partial(from_plain, TrialRecord))
"""A verification's record, kept as plain data."""
_RECORDS = Codec(
    lambda records: [_RECORD.encode(r) for r in records],
    lambda plain: [_RECORD.decode(p) for p in plain],
)
"""The contenders' records, re-timed."""
_EXPERT = "the expert's recipe"
"""What a skipped run of the expert's recipe is named by (``max_tuning_s``)."""


@dataclass(frozen=True)
class Verification:
    """What verification decided."""

    chosen: TrialRecord
    """The winner, its config with its evaluation batch."""
    chooser: Chooser
    """The winner's layout's chooser (what predicts it)."""
    records: list[TrialRecord]
    """Every config run, rejected ones included."""
    fallbacks: list[TrainConfig]
    """The ladder below the winner, each with its evaluation batch."""
    tied: list[TrainConfig]
    """The configs the winner is not known to be ahead of."""
    noise: float
    """The noise of one timing that decided."""
    expert: TrialRecord | None
    """The expert's recipe, verified: the config to beat."""
    expert_note: str = ""
    """Why there is no expert's recipe, or how it differs from the expert's."""
    skipped: tuple[str, ...] = ()
    """What was not run for the run's time budget (``max_tuning_s``)."""


def verification(
    verifier: Verifier,
    choosers: Sequence[Chooser],
    candidates: list[Candidate],
    jobs: JobStore,
    *,
    plan: TuneResult | None,
    started: CpuClock | None,
    eval_batch: int | None,
    most: int,
    ends: float | None = None,
) -> Verification:
    """Run the best ``candidates`` for real (``plan``'s config first, where there is
    one), the expert's recipe beside them, and decide.

    Args:
        verifier: Runs one config on the device, under the budget.
        choosers: The search's choosers, one per layout.
        candidates: Their candidates, fastest predicted first.
        jobs: Where each run is done once.
        plan: A plan or earlier result to verify first (its prediction kept, to compare).
        started: The CPU's clock when the run began (how busy the machine has been).
        eval_batch: The evaluation batch the user wants (``None``: the largest that fits).
        most: The largest micro-batch (and evaluation batch) the space allows.
        ends: When the run must end (``max_tuning_s``, ``time.perf_counter``'s clock):
            past the first candidate, each run of a config only where one as long as the
            longest so far still ends in time (:class:`TimeBudget`); what was not run is
            in the verification's ``skipped``. ``None``: no limit.
    """
    budget = TimeBudget(ends)
    device = verifier.device
    measure = _measured(verifier, jobs, budget)
    first = _plan_first(measure, plan)
    if plan is not None:
        candidates = [c for c in candidates if c.config != plan.config]
    # Other work on the cores while profiling: the calibrated predictions are looser.
    slack = _load("profiled", jobs, started, device).slack
    tried = first + choose_winner(measure, candidates, top=VERIFY_TOP, slack=slack, budget=budget)
    experts = baseline_candidates(choosers, device.type)
    # The config to beat, every run (the budget allowing).
    baseline, unrun = verify_baseline(
        _within(measure, budget, _EXPERT), experts, tried, slack=slack
    )
    tried += baseline
    noise = _load("verified", jobs, started, device)  # and while verifying: raced harder
    records = tried
    if budget.allows("re-timing the contenders"):
        records = jobs.once(
            job_key("settle", *(r.config for r in tried)),
            lambda: settle(verifier, tried, noise),
            "re-timing the contenders",
            _RECORDS,
        )
    chosen = fastest(_predictable(records, choosers) or records, noise)
    chooser = chooser_of(choosers, chosen.config)
    tied, sigma = tied_with(chosen, _predictable(records, [chooser]), noise)
    # A fallback's peak is verified as any config's, over two micro-batches a step.
    peaks = _within(_measured(verifier, jobs, budget, timed=False), budget, "the fallback")
    ladder = fallback_ladder(peaks, chooser, chosen, records)
    sized = [chosen.config, *ladder]
    if budget.allows("sizing the evaluation batch"):
        sized = with_eval_batches(verifier, sized, eval_batch, most)
    chosen = dataclasses.replace(chosen, config=sized[0])
    expert = baseline_record(records, experts)
    note = "; ".join(n for n in (experts.note, unrun) if n)
    if any(s.startswith(_EXPERT) for s in budget.skipped):
        # Not found as an expert finds it (from the largest micro-batch down): none.
        expert, note = None, "not run: max_tuning_s was spent before it"
    elif expert is None and experts.ladders:
        note = (
            unrun or "it ran out of memory or over the budget at every micro-batch predicted to fit"
        )
    return Verification(
        chosen, chooser, records, sized[1:], tied, sigma, expert, note, tuple(budget.skipped)
    )


def _predictable(records: list[TrialRecord], choosers: Sequence[Chooser]) -> list[TrialRecord]:
    """The records whose config the profile can predict: a plan's config is verified even
    in a precision the profile dropped (measured slow here) or with an optimizer not
    profiled (``adamw`` where the space searched it fused), and is then no contender."""
    profile = choosers[0].cost.profile
    return [
        r
        for r in records
        if r.config.timeline in profile.precisions and r.config.optimizer in profile.optimizers
    ]


def _plan_first(measure: Measure, plan: TuneResult | None) -> list[TrialRecord]:
    """The plan's config run (its prediction kept, to compare with the measurement)."""
    if plan is None:
        return []
    log.info("verifying the plan: %s", plan.config.describe())
    record = measure(plan.config, plan.predicted)
    return [record] if record is not None else []


def _load(stage: str, jobs: JobStore, started: CpuClock | None, device: torch.device) -> Noise:
    """How noisy the machine was up to ``stage``, read once per study. Every rank decides
    alike (verification's rounds are collectives): busy where any rank saw others' work
    take its cores."""
    now = CpuClock.now()
    seen = float(bool(started and now and busy(now.others_since(started))))
    here = bool(agree_max([seen], device)[0])  # on every rank: its ranks agree on it
    loaded = jobs.once(job_key(f"busy-{stage}"), lambda: here, "reading the load")
    return BUSY if loaded else QUIET


def _measured(
    verifier: Verifier, jobs: JobStore, budget: TimeBudget, *, timed: bool = True
) -> Measure:
    """Run configs for real, each once among the processes that share the jobs, each
    run's seconds counted in ``budget``. ``timed=False``: their peak alone (see
    :meth:`Verifier.run`)."""
    kind = "verify" if timed else "verify-once"

    def measure(
        config: TrainConfig, predicted: Measurement, /, beat: float = 0.0
    ) -> TrialRecord | None:
        record: TrialRecord = budget.timed(
            lambda: jobs.once(
                job_key(kind, config),
                lambda: verifier.record(config, predicted, timed=timed, beat=beat),
                f"verifying {config.describe()}",
                _RECORD,
            )
        )
        return record

    return measure


def _within(measure: Measure, budget: TimeBudget, what: str) -> Measure:
    """``measure`` where ``budget`` allows a run; where it does not, ``what`` and the
    config are recorded as skipped and the run is ``None`` (as one another process has)."""

    def run(
        config: TrainConfig, predicted: Measurement, /, beat: float = 0.0
    ) -> TrialRecord | None:
        if not budget.allows(f"{what} {config.describe()}"):
            return None
        return measure(config, predicted, beat)

    return run
