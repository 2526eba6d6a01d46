"""A tuning run on the device: a model at one sequence length and one attention
implementation, measured, searched and verified (:mod:`autotune.tuning._pipeline`).

The user's model is only read (deep-copied); every measurement runs on the copy. Each
expensive stage is a job of the run's :class:`~autotune.jobs.JobStore`: in memory, or
with ``storage`` an Optuna study that processes share and a resumed run reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune._format import format_bytes
from autotune._plain_data import from_plain, to_plain
from autotune._profile_data import Profile, profile_from_json, profile_to_json
from autotune._version import __version__
from autotune.config import TrainConfig
from autotune.cost import CostModel, Planner, planner_of
from autotune.device import CpuClock, backend_for, busy, busy_note
from autotune.jobs import (
    Codec,
    JobStore,
    LocalJobs,
    Relayed,
    StudyStore,
    job_id,
    job_key,
    resolve_storage,
)
from autotune.measure import measure_collectives, whole_fits, working_copy
from autotune.result import Measurement, ModelInfo, TrialRecord, TuneResult
from autotune.train import (
    agree_max,
    broadcast,
    fingerprint,
    group_size,
    measured_compiling,
    rank,
    rank_zero,
)
from autotune.tuning._data_parallel import planned_result
from autotune.tuning._evaluation import with_eval_batches
from autotune.tuning._options import TuneOptions
from autotune.tuning._pipeline import Ranked, ranked, run
from autotune.tuning._problem import Problem, make_problem
from autotune.tuning._profiling import budget_cap, profile_model
from autotune.tuning._stopwatch import Stopwatch
from autotune.verify import (
    BUSY,
    MOST_NOISE,
    QUIET,
    Measure,
    Noise,
    Verifier,
    baseline_candidates,
    baseline_record,
    choose_winner,
    fallback_ladder,
    fastest,
    settle,
    tied_with,
    verify_baseline,
)

__all__ = ["DeviceRun", "job_store", "tune_on_device"]

log = logging.getLogger("autotune")

VERIFY_TOP = 3
"""Candidates verified for real, fastest predicted first (more where the first fail)."""


@dataclass
class _Verified:
    """What verification decided: the winner, every record, the fallback ladder, and how
    noisy the machine's timings were taken to be."""

    chosen: TrialRecord
    records: list[TrialRecord]
    fallbacks: list[TrainConfig]
    noise: Noise
    expert: TrialRecord | None


def tune_on_device(model: nn.Module, sample: Any, options: TuneOptions) -> TuneResult:
    """:func:`autotune.autotune` at the sample's length, with the model's attention."""
    watch, cpu = Stopwatch(), CpuClock.now()
    problem = make_problem(model, sample, options)
    jobs = job_store(model, problem, options)  # a storage that cannot open: before any work
    # In a process group only rank 0 profiles on the device; verification wraps a copy per
    # config, which puts on the device what the config says (a shard under FSDP).
    # A model too large for one device whole is profiled on shallow copies (FSDP2's case).
    whole = whole_fits(model, problem.target.free_bytes, problem.world)
    on_device = rank() == 0 and whole
    work = working_copy(model, problem.target.device if on_device else torch.device("cpu"))
    stages = DeviceRun(model, work, jobs, options, cpu, whole)
    try:
        result = run(contextlib.nullcontext(problem), stages, watch)
    finally:
        del work, stages
        gc.collect()
        backend_for(problem.target.device).empty_cache()
    result = dataclasses.replace(
        result,
        tuning_s=watch.elapsed(),
        spent=watch.spent(),
        busy=_busy(cpu, result.noise) if result.measured is not None else None,
    )
    return broadcast(result) if group_size() > 1 else result  # the same on every rank


def job_store(model: nn.Module, problem: Problem, options: TuneOptions) -> JobStore:
    """Where the run's jobs are done once: in memory, or the study kept in
    ``options.storage`` for this run (made for this release, model, budget and space;
    the default name says so, so another release starts a study of its own)."""
    if options.storage is None:
        return LocalJobs()
    key = {
        "autotune": __version__,
        "model": fingerprint(model),
        "budget_bytes": problem.budget,
        "device": problem.target.name,
        "global_batch_size": problem.global_batch_size,
        "space": repr(problem.space),
        "torch": str(torch.__version__),
    }
    name = options.study_name or f"autotune-{job_id(json.dumps(key, sort_keys=True))[:16]}"
    return StudyStore(resolve_storage(options.storage), name, key)


PROFILE = Codec(profile_to_json, profile_from_json)
"""A profile job's result, kept as its JSON."""
RECORD = Codec(to_plain, functools.partial(from_plain, TrialRecord))
"""A verification's record, kept as plain data."""
RECORDS = Codec(
    lambda records: [RECORD.encode(r) for r in records],
    lambda plain: [RECORD.decode(p) for p in plain],
)
"""The contenders' records, re-timed."""


class DeviceRun:
    """The stages of a run on the device (see :class:`~autotune.tuning._pipeline.Stages`).

    Args:
        model: The user's model (read only).
        work: The tuner's copy, which every stage measures.
        jobs: Where each expensive job is done once.
        options: The run's options.
        cpu: The CPU's clock when the run began (how busy the machine was since).
        whole: Whether the model fits the device whole (else shallow copies).
    """

    def __init__(
        self,
        model: nn.Module,
        work: nn.Module,
        jobs: JobStore,
        options: TuneOptions,
        cpu: CpuClock | None,
        whole: bool,
    ) -> None:
        self.model, self.work, self.jobs, self.options = model, work, jobs, options
        self.cpu, self.whole = cpu, whole
        self.leader = Relayed(jobs, rank_zero)  # profiling and search: rank 0's, sent to all

    @contextlib.contextmanager
    def holding(self, problem: Problem) -> Iterator[None]:
        """The budget held from the first byte, and compiled blocks measured where searched."""
        with budget_cap(problem), measured_compiling(problem.compile or problem.compile_model):
            yield

    def profile(self, problem: Problem) -> Profile:
        """Measured on rank 0 (once among a study's processes), with the process group's
        collectives timed on every rank."""

        def measure() -> Profile:
            return profile_model(self.work, problem, whole=self.whole)

        profile: Profile = self.leader.once("profile", measure, "profiling the model", PROFILE)
        if group_size() > 1:
            self.work.to(torch.device("cpu"))
            backend_for(problem.target.device).empty_cache()
            comm = measure_collectives(problem.target.device)
            profile = dataclasses.replace(profile, comm=comm)
        return profile

    def search(self, profile: Profile, problem: Problem) -> Ranked:
        return ranked(profile, problem, self.options, self.leader)

    def verify(self, problem: Problem, profile: Profile, searched: Ranked) -> TuneResult:
        """The best candidates run for real; planned where the ranks are not here."""
        if not problem.verifiable:
            info = model_info(self.model, profile.blocks)
            return planned_result(info, problem, profile, searched.candidates)
        verified = self._verified(problem, searched)
        planner = planner_of(searched.planners, verified.chosen.config)
        return _result(self.model, problem, profile, planner, verified)

    def _verified(self, problem: Problem, searched: Ranked) -> _Verified:
        """Run the best candidates for real (a plan's config first, where there is one):
        the winner, every record, the fallback ladder; the winner and its fallbacks with
        their evaluation batch sizes."""
        found, candidates, plan = searched.planners, searched.candidates, self.options.start_from
        verifier = Verifier.of(
            problem.workload(self.work), problem.budget, problem.target.context_bytes
        )
        measure = self._measure(verifier)
        first: list[TrialRecord] = []
        if plan is not None:
            log.info("verifying the plan: %s", plan.config.describe())
            record = measure(plan.config, plan.predicted)  # the plan's prediction, to compare
            first = [record] if record is not None else []
            candidates = [c for c in candidates if c.config != plan.config]
        # Other work on the cores while profiling: the calibrated predictions are looser.
        slack = self._load("profiled", problem).slack
        tried = first + choose_winner(measure, candidates, top=VERIFY_TOP, slack=slack)
        experts = baseline_candidates(found, problem.target.device.type)
        tried += verify_baseline(measure, experts, tried)  # the config to beat, every run
        noise = self._load("verified", problem)  # and while verifying: raced harder
        records = self.jobs.once(
            job_key("settle", *(r.config for r in tried)),
            lambda: settle(verifier, tried, noise),
            "re-timing the contenders",
            RECORDS,
        )
        chosen = fastest(_predictable(records, found) or records, noise)
        planner = planner_of(found, chosen.config)
        # A fallback's peak is verified as any config's; one step times it, for the order.
        ladder = fallback_ladder(self._measure(verifier, timed=False), planner, chosen, records)
        most = problem.space.max_micro_batch_size
        wanted = self.options.eval_batch_size
        sized = with_eval_batches(verifier, [chosen.config, *ladder], wanted, most)
        chosen = dataclasses.replace(chosen, config=sized[0])
        return _Verified(chosen, records, sized[1:], noise, baseline_record(records, experts))

    def _load(self, stage: str, problem: Problem) -> Noise:
        """How noisy the machine was up to ``stage``, read once per study: a run that
        resumes it (or another process of it) decides as the first did, and so verifies
        and re-times the same configs, reading their results instead of measuring again."""
        now = _machine(self.cpu, problem) is BUSY  # on every rank: its ranks agree on it
        busy = self.jobs.once(job_key(f"busy-{stage}"), lambda: now, "reading the load")
        return BUSY if busy else QUIET

    def _measure(self, verifier: Verifier, *, timed: bool = True) -> Measure:
        """Run configs for real, each once among the processes that share the jobs.
        ``timed=False``: their speed from one step (see :meth:`Verifier.run`)."""
        kind = "verify" if timed else "verify-once"

        def measure(config: TrainConfig, predicted: Measurement) -> TrialRecord | None:
            record: TrialRecord = self.jobs.once(
                job_key(kind, config),
                lambda: verifier.record(config, predicted, timed=timed),
                f"verifying {config.describe()}",
                RECORD,
            )
            return record

        return measure


def _machine(start: CpuClock | None, problem: Problem) -> Noise:
    """How noisy the machine has been since ``start``: busy where others' work took its
    cores. Every rank decides alike (verification's rounds are collectives): busy where
    any rank saw it busy."""
    now = CpuClock.now()
    seen = float(bool(start and now and busy(now.others_since(start))))
    return BUSY if agree_max([seen], problem.target.device)[0] else QUIET


def _result(
    model: nn.Module, problem: Problem, profile: Profile, planner: Planner, verified: _Verified
) -> TuneResult:
    """The verified winner, with what was predicted for it and the ladder below it."""
    chosen = verified.chosen
    assert chosen.measured is not None
    prediction = planner.cost.predict(chosen.config)
    _allocator_note(planner.cost, chosen.config)
    tied, noise = tied_with(chosen, _predictable(verified.records, [planner]), verified.noise)
    return TuneResult(
        config=chosen.config,
        predicted=prediction.measurement,
        measured=chosen.measured,
        budget_bytes=problem.budget,
        target=problem.target.info(),
        model=model_info(model, profile.blocks),
        breakdown=prediction.breakdown,
        fallbacks=tuple(verified.fallbacks),
        trials=tuple(verified.records),
        tied=tuple(tied),
        noise=noise,
        expert=verified.expert,
    )


def _allocator_note(cost: CostModel, config: TrainConfig) -> None:
    """Say so where the caching allocator's other ``expandable_segments`` setting would
    hold the winner in 1% less, as the allocator's model predicts it."""
    modes = cost.other_allocator_mode(config) if config.parallel == "none" else None
    if modes is None:
        return
    other, now, then = modes
    if then < 0.99 * now:
        log.info(
            "the allocator's model predicts this config's peak at %s with "
            "PYTORCH_CUDA_ALLOC_CONF=%s (set before CUDA starts), against %s predicted "
            "with the setting it was tuned with",
            format_bytes(then),
            other,
            format_bytes(now),
        )


def _predictable(records: list[TrialRecord], found: Sequence[Planner]) -> list[TrialRecord]:
    """The records whose config the profile can predict: a plan's config is verified even
    in a precision the profile dropped (measured slow here) or with an optimizer not
    profiled (``adamw`` where the space searched it fused), and is then no contender."""
    profile = found[0].cost.profile
    return [
        r
        for r in records
        if r.config.timeline in profile.precisions and r.config.optimizer in profile.optimizers
    ]


def _busy(start: CpuClock | None, noise: float) -> str | None:
    """Whether the machine was busy while tuning, said once (see :func:`busy_note`)."""
    end = CpuClock.now()
    others = end.others_since(start) if start is not None and end is not None else None
    note = busy_note(others, noise if noise >= MOST_NOISE else None)
    if note is not None:
        log.warning("%s", note)
    return note


def model_info(model: nn.Module, blocks: Sequence[str]) -> ModelInfo:
    """What the result records of the tuned model."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    classes = dict.fromkeys(type(model.get_submodule(b)).__name__ for b in blocks)
    return ModelInfo(type(model).__qualname__, fingerprint(model), n, tuple(blocks), tuple(classes))
