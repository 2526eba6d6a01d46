"""A tuning run's verification, top to bottom: the plan's config first, the best
candidates, the expert's recipe, the contenders timed again, the winner, its fallback
ladder and their evaluation batches.

Each run of a config is a job done once among the processes that share the run's jobs (a
kept study's, a process group's), and so is each reading of the machine's load: a run
that resumes a study (or another process of it) decides as the first did, so it verifies
and re-times the same configs, reading their results instead of measuring again.

The baseline: the expert's recipe (:func:`autotune.cost.expert_candidates`), verified
in every run beside the tuner's own candidates and timed the same way, so that the winner
is never measured slower than what a knowledgeable user writes by hand, and the result
says how it compares.

The fallback ladder: verified configurations to fall back to when training runs out of
memory, fastest first, each with a smaller measured peak than the one before.
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
from autotune.cost import (
    Candidate,
    Chooser,
    ExpertRecipe,
    chooser_of,
    expert_candidates,
    fallback_candidates,
)
from autotune.device import CpuClock, busy
from autotune.jobs import Codec, JobStore, job_key
from autotune.result import Measurement, TrialRecord, TuneResult
from autotune.train import agree_max
from autotune.verify._noise import BUSY, QUIET, Noise
from autotune.verify._verifier import Verifier, with_eval_batches
from autotune.verify._winner import (
    Measure,
    TimeBudget,
    at_most,
    choose_winner,
    fastest,
    retime_contenders,
    tied_with,
)

__all__ = [
    "VERIFY_TOP",
    "Verification",
    "baseline_candidates",
    "baseline_record",
    "fallback_ladder",
    "verification",
    "verify_baseline",
]

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
    largest_batch: int,
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
        largest_batch: The largest micro-batch (and evaluation batch) the space allows.
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
            job_key("retime_contenders", *(r.config for r in tried)),
            lambda: retime_contenders(verifier, tried, noise),
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
        sized = with_eval_batches(verifier, sized, eval_batch, largest_batch)
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
    :meth:`Verifier.trial`)."""
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
                bound = at_most(cand.prediction.measurement.samples_per_s, tried, slack)
                if bound is not None and bound < best:
                    hopeless.append(
                        f"{cand.config.describe()} left out, as it cannot win (predicted at "
                        f"most {bound:.1f} samples/s, {best:.1f} measured)"
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
