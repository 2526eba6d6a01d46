"""``autotune()``: the pipeline end to end, orchestration only.

target -> profile -> cost model -> Optuna search -> verification -> result (see
ARCHITECTURE.md). The user's model is only read (deep-copied); every measurement runs on
the copy.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autotune._backend import backend_for
from autotune._data_parallel import (
    layouts,
    per_rank_batch,
    planned_result,
    planner_of,
    rank_zero,
    search_layouts,
    world_of,
)
from autotune._identity import fingerprint
from autotune._problem import Problem, make_problem
from autotune._shared import (
    measure_with,
    open_store,
    shared_profile,
    shared_settle,
)
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.measure._collectives import measure_collectives
from autotune.measure._devices import measure_transfer
from autotune.measure._memory_profile import memory_profile, sharded_precisions, working_copy
from autotune.measure._profile_data import Profile
from autotune.measure._profiler import Profiler
from autotune.measure._time_profile import fast_precisions, time_profile
from autotune.plan._candidates import largest_fitting
from autotune.plan._cost import CostModel
from autotune.plan._planner import Candidate, Planner
from autotune.plan._too_small import too_small
from autotune.result import ModelInfo, Spent, TrialRecord, TuneResult
from autotune.space import SearchSpace
from autotune.train._loss import LossFn
from autotune.train._parallel import broadcast, group_size, rank
from autotune.verify._ladder import fallback_ladder
from autotune.verify._studies import StudyStore
from autotune.verify._verifier import Verifier
from autotune.verify._winner import choose_winner, fastest

__all__ = ["autotune"]

log = logging.getLogger("autotune")

_VERIFY_TOP = 3


def autotune(
    model: nn.Module,
    sample_batch: Any,
    budget_gb: float = 24.0,
    *,
    loss_fn: LossFn | None = None,
    global_batch_size: int | None = None,
    device: torch.device | str | None = None,
    space: SearchSpace | None = None,
    n_trials: int | None = None,
    timeout_s: float | None = None,
    seed: int = 0,
    storage: str | None = None,
    study_name: str | None = None,
    world_size: int | None = None,
) -> TuneResult:
    """Find the fastest training configuration of ``model`` whose peak memory fits the budget.

    Args:
        model: The model to tune; left exactly as it was.
        sample_batch: One batch (Tensor, tuple/list or dict; batch dimension 0); batches of
            any size are made from it. Tune at the longest sequence you will train on.
        budget_gb: Device memory the training run may use, in GiB.
        loss_fn: ``loss_fn(output, batch) -> scalar``; default: a scalar output,
            ``output.loss``, or the first element of a tuple output.
        global_batch_size: Samples per optimizer step, kept exact with accumulation;
            default: no accumulation, the micro-batch is the batch.
        device: Target device; default CUDA if available, else CPU.
        space: Knobs to search; default :class:`SearchSpace()`.
        n_trials: Optuna trials on the cost model, for a space too large to enumerate
            (default: scaled to the space); a space of up to 4096 settings that can fit
            is enumerated exactly.
        timeout_s: Time limit of the Optuna study (a large space only).
        seed: Seed of the study; the same profile gives the same configuration.
        storage: Where to keep the study, to resume it or share it between processes: an
            Optuna URL (``sqlite:///tune.db``, ``postgresql://...``), a ``*.journal`` file
            path (a journal file, for several processes), or another path (SQLite). The
            study keeps the profile and every verification, which are not redone.
        study_name: Name of the study in the storage; default: from the model and budget.
        world_size: Ranks to train on with data parallelism (DDP or FSDP2, searched). Inside
            a process group (``torchrun``) every rank calls this and the group is tuned on
            (default: its size); every rank returns the same result. In one process, a
            world size other than 1 is planned without running it, and the result's
            ``unverified`` says what that leaves out. The global batch is
            ``micro x accumulation x world_size``.

    Returns:
        The verified winner, its predicted and measured numbers, and fallbacks.

    Raises:
        BudgetError, BudgetTooSmallError, BatchError, LossError, BlockError, ProfileError,
        VerificationError: each with a message that says what to do.
    """
    started = time.perf_counter()
    world, here = world_of(world_size)
    problem = make_problem(
        model,
        sample_batch,
        budget_gb,
        loss_fn=loss_fn,
        global_batch_size=per_rank_batch(global_batch_size, world),
        device=device,
        space=space or SearchSpace(),
    )
    if storage is not None and world > 1:
        raise ConfigError("storage= is not supported with data parallelism yet; leave it out.")
    store = None if storage is None else open_store(model, problem, storage, study_name)
    # In a process group only rank 0 profiles on the device; verification wraps a copy per
    # config, which puts on the device what the config says (a shard under FSDP).
    host = torch.device("cpu")
    work = working_copy(model, problem.target.device if rank() == 0 else host)
    try:
        clock = [time.perf_counter()]  # the ends of profiling, search and verification
        measure_profile = functools.partial(_profile, work, problem, world)
        if store is None:
            profile = rank_zero(measure_profile)
        else:
            profile = shared_profile(store, measure_profile)
        if group_size() > 1:
            work.to(host)
            backend_for(problem.target.device).empty_cache()
            profile = dataclasses.replace(profile, comm=measure_collectives(problem.target.device))
        clock.append(time.perf_counter())
        problem = problem.with_context(profile.context_bytes)
        planners = [
            problem.planner(CostModel(profile, layout), tuple(profile.precisions))
            for layout in layouts(world, profile.blocks)
        ]
        candidates = rank_zero(lambda: search_layouts(planners, store, n_trials, timeout_s, seed))
        clock.append(time.perf_counter())
        if not here:
            clock.append(time.perf_counter())
            info = _model_info(model, profile.blocks)
            return planned_result(info, problem, profile, candidates, started, clock)
        chosen, records, fallbacks = _verify(work, problem, planners, candidates, store)
        clock.append(time.perf_counter())
    finally:
        del work
        gc.collect()
        backend_for(problem.target.device).empty_cache()

    assert chosen.measured is not None
    prediction = planner_of(planners, chosen.config).cost.predict(chosen.config)
    result = TuneResult(
        config=chosen.config,
        predicted=prediction.measurement,
        measured=chosen.measured,
        budget_bytes=problem.budget,
        target=problem.target.info(),
        model=_model_info(model, profile.blocks),
        breakdown=prediction.breakdown,
        fallbacks=tuple(fallbacks),
        trials=tuple(records),
        tuning_s=time.perf_counter() - started,
        spent=Spent(*(b - a for a, b in itertools.pairwise(clock))),
    )
    return broadcast(result) if group_size() > 1 else result  # the same on every rank


def _verify(
    work: nn.Module,
    problem: Problem,
    planners: list[Planner],
    candidates: list[Candidate],
    store: StudyStore | None,
) -> tuple[TrialRecord, list[TrialRecord], list[TrainConfig]]:
    """Run the best candidates for real: (the winner, every record, the fallback ladder)."""
    verifier = Verifier(
        work,
        problem.sample,
        device=problem.target.device,
        budget_bytes=problem.budget,
        loss_fn=problem.loss_fn,
        context_bytes=problem.target.context_bytes,
        foreign_bytes=problem.foreign,
        blocks=problem.blocks,
    )
    measure = measure_with(verifier, store)
    records = shared_settle(store, verifier, choose_winner(measure, candidates, top=_VERIFY_TOP))
    chosen = fastest(records)
    planner = planner_of(planners, chosen.config)
    return chosen, records, fallback_ladder(measure, planner, chosen, records)


def _profile(work: nn.Module, problem: Problem, world: int = 1) -> Profile:
    """Measure memory first (cheap, decides what fits), then time only what can fit.

    With offload searched, host<->device bandwidth, the offloaded variant and the host step
    of each optimizer are measured too. What fits is decided over the data parallelism of
    ``world`` ranks.

    Raises:
        BudgetTooSmallError: nothing in the space fits the budget.
    """
    t0 = time.perf_counter()
    target = problem.target
    profiler = Profiler(
        work,
        problem.sample,
        problem.blocks,
        device=target.device,
        loss_fn=problem.loss_fn,
        foreign_bytes=problem.foreign,
    )
    precisions, slow = fast_precisions(profiler, problem.precisions, device_name=target.name)
    log.info("profiling memory on %s (%d blocks)", target.name, len(problem.blocks))
    draft, notes = memory_profile(
        profiler,
        precisions,
        problem.space.optimizers,
        device_name=target.name,
        context_bytes=target.context_bytes,
        transfer=measure_transfer(target) if problem.offload else None,
    )
    if world > 1:  # FSDP2 computes bf16 with bf16 parameters: their own timeline
        draft = sharded_precisions(profiler, draft, problem.space.optimizers[0])
    # Training steps have run: the context now holds cuBLAS workspaces and the kernels
    # loaded lazily, which discover() could not see yet.
    context = max(target.context_bytes, backend_for(target.device).context_bytes())
    draft = dataclasses.replace(draft, context_bytes=context)
    planners = [
        problem.planner(CostModel(draft, layout), tuple(draft.precisions))
        for layout in layouts(world, draft.blocks)
    ]
    planner = planners[0]
    caps = {
        p: max(
            (
                b
                for q in planners
                for o in q.optimizers
                if p in q.precisions and (b := largest_fitting(q, p, o))
            ),
            default=None,
        )
        for p in draft.precisions
    }
    feasible = {p: b for p, b in caps.items() if b is not None}
    if not feasible:
        helps = not backend_for(problem.target.device).host_is_device
        raise too_small(planner, problem.space, problem.budget, offload_helps=helps)
    log.info("profiling time at micro-batch sizes up to %s", max(feasible.values()))
    draft = dataclasses.replace(draft, notes=(*slow, *notes))
    profile = time_profile(profiler, draft, feasible, problem.sizes, device_name=target.name)
    for note in profile.notes:
        log.info("note: %s", note)
    return dataclasses.replace(profile, seconds=time.perf_counter() - t0)


def _model_info(model: nn.Module, blocks: Sequence[str]) -> ModelInfo:
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    classes = dict.fromkeys(type(model.get_submodule(b)).__name__ for b in blocks)
    return ModelInfo(type(model).__qualname__, fingerprint(model), n, tuple(blocks), tuple(classes))
