"""One tuning run: a model at one sequence length and one attention implementation.

profile -> planners -> search -> verification -> result (see ARCHITECTURE.md). The user's
model is only read (deep-copied); every measurement runs on the copy.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.config import TrainConfig
from autotune.device import CpuClock, backend_for, busy, busy_note
from autotune.measure import Profile, measure_collectives, whole_fits, working_copy
from autotune.plan import Candidate, Planner, planner_of, planners
from autotune.result import ModelInfo, Spent, TrialRecord, TuneResult
from autotune.train import (
    agree_max,
    broadcast,
    fingerprint,
    group_size,
    measured_compiling,
    rank,
    rank_zero,
)
from autotune.tuning._data_parallel import planned_result, search_layouts
from autotune.tuning._evaluation import with_eval_batches
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem, make_problem
from autotune.tuning._profiling import held, profile_model
from autotune.tuning._study import measure_with, open_store, shared_profile, shared_settle
from autotune.verify import (
    BUSY,
    MOST_NOISE,
    QUIET,
    Noise,
    StudyStore,
    Verifier,
    choose_winner,
    fallback_ladder,
    fastest,
    tied_with,
)

__all__ = ["tune_once"]

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


def tune_once(model: nn.Module, sample: Any, options: TuneOptions) -> TuneResult:
    """:func:`autotune.autotune` at the sample's length, with the model's attention."""
    started, cpu = time.perf_counter(), CpuClock.now()
    problem = make_problem(model, sample, options)
    store = None
    if options.storage is not None:
        store = open_store(model, problem, options.storage, options.study_name)
    # In a process group only rank 0 profiles on the device; verification wraps a copy per
    # config, which puts on the device what the config says (a shard under FSDP).
    # A model too large for one device whole is profiled on shallow copies (FSDP2's case).
    whole = whole_fits(model, problem.target.free_bytes, problem.world)
    on_device = rank() == 0 and whole
    work = working_copy(model, problem.target.device if on_device else torch.device("cpu"))
    clock = [time.perf_counter()]  # the ends of profiling, search and verification
    try:
        # The budget holds from the first byte: profiling, compiling and verifying.
        with held(problem), measured_compiling(problem.compile):  # compiled: where searched
            profile = _profile(work, problem, store, whole=whole)
            clock.append(time.perf_counter())
            problem = problem.with_context(profile.context_bytes)
            found = planners(profile, problem, problem.world)
            candidates = rank_zero(lambda: search_layouts(found, store, options))
            clock.append(time.perf_counter())
            if not problem.verifiable:
                clock.append(time.perf_counter())
                info = model_info(model, profile.blocks)
                return planned_result(info, problem, profile, candidates, started, clock)
            verified = _verify(work, problem, found, candidates, store, options, cpu)
            clock.append(time.perf_counter())
    finally:
        del work
        gc.collect()
        backend_for(problem.target.device).empty_cache()
    planner = planner_of(found, verified.chosen.config)
    result = _result(model, problem, profile, planner, verified)
    result = dataclasses.replace(
        result,
        tuning_s=time.perf_counter() - started,
        spent=Spent.between(clock),
        busy=_busy(cpu, result.noise),
    )
    return broadcast(result) if group_size() > 1 else result  # the same on every rank


def _profile(
    work: nn.Module, problem: Problem, store: StudyStore | None, *, whole: bool
) -> Profile:
    """The run's profile: measured on rank 0 (once among a study's processes), with the
    process group's collectives timed on every rank."""

    def measure() -> Profile:
        return profile_model(work, problem, whole=whole)

    profile = rank_zero(measure) if store is None else shared_profile(store, measure)
    if group_size() > 1:
        work.to(torch.device("cpu"))
        backend_for(problem.target.device).empty_cache()
        comm = measure_collectives(problem.target.device)
        profile = dataclasses.replace(profile, comm=comm)
    return profile


def _verify(
    work: nn.Module,
    problem: Problem,
    found: list[Planner],
    candidates: list[Candidate],
    store: StudyStore | None,
    options: TuneOptions,
    cpu: CpuClock | None,
) -> _Verified:
    """Run the best candidates for real (a plan's config first, where there is one): the
    winner, every record, the fallback ladder; the winner and its fallbacks with their
    evaluation batch sizes."""
    plan = options.start_from
    verifier = Verifier.of(problem.workload(work), problem.budget, problem.target.context_bytes)
    measure = measure_with(verifier, store)
    first: list[TrialRecord] = []
    if plan is not None:
        log.info("verifying the plan: %s", plan.config.describe())
        record = measure(plan.config, plan.predicted)  # the plan's prediction, to compare
        first = [record] if record is not None else []
        candidates = [c for c in candidates if c.config != plan.config]
    # Other work on the cores while profiling: the calibrated predictions are looser.
    slack = _machine(cpu, problem).slack
    tried = first + choose_winner(measure, candidates, top=VERIFY_TOP, slack=slack)
    noise = _machine(cpu, problem)  # and while verifying: raced harder (see verify.BUSY)
    records = shared_settle(store, verifier, tried, noise)
    chosen = fastest(_predictable(records, found) or records, noise)
    planner = planner_of(found, chosen.config)
    # A fallback's peak is verified as any config's; one step times it, for the ladder's order.
    once = measure_with(verifier, store, timed=False)
    ladder = fallback_ladder(once, planner, chosen, records)
    most = problem.space.max_micro_batch_size
    sized = with_eval_batches(verifier, [chosen.config, *ladder], options.eval_batch_size, most)
    chosen = dataclasses.replace(chosen, config=sized[0])
    return _Verified(chosen, records, sized[1:], noise)


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
