"""The tuner's profile: memory first (cheap, decides what fits), then time only what can fit.

A model trained sharded over several ranks may not fit the one device its profile runs on;
then, where its blocks are one container's uniform layers, it is profiled on copies with 3
and 4 of them and extended to its depth (:mod:`autotune.measure._depth`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from torch import nn

from autotune._backend import backend_for
from autotune._data_parallel import layouts
from autotune._problem import Problem
from autotune.measure._depth import deepen, deepen_time, shallow_copies
from autotune.measure._devices import measure_transfer
from autotune.measure._memory_profile import memory_profile, sharded_precisions
from autotune.measure._profile_data import Profile
from autotune.measure._profiler import Profiler
from autotune.measure._time_profile import fast_precisions, time_profile
from autotune.plan._candidates import largest_fitting
from autotune.plan._cost import CostModel
from autotune.plan._too_small import too_small

__all__ = ["profile_model"]

log = logging.getLogger("autotune")


def profile_model(
    work: nn.Module, problem: Problem, world: int = 1, *, whole: bool = True
) -> Profile:
    """The profile of ``work`` (the tuner's copy), what fits decided over the data
    parallelism of ``world`` ranks.

    Not ``whole`` (see :func:`~autotune.measure._depth.whole_fits`), ``work`` is on the
    host and profiled on shallow copies where it can be (else moved to the device and
    profiled whole). With offload searched, host<->device bandwidth, the offloaded variant
    and the host step of each optimizer are measured too.

    Raises:
        BudgetTooSmallError: nothing in the space fits the budget.
        ProfileError: the model cannot be trained on the sample batch, or does not fit.
    """
    t0 = time.perf_counter()
    device = problem.target.device
    copies = None
    if not whole:
        copies = shallow_copies(work, problem.blocks)
        if copies is None:
            log.info("the blocks are not uniform layers: profiling the whole model")
            work.to(device)
    if copies is None:
        profiler = _profiler(work, problem)
        precisions, untrainable, slow, timed = fast_precisions(
            profiler, problem.precisions, problem.sizes, device_name=problem.target.name
        )
        compiled = _worth_compiling(precisions, timed) if world == 1 and problem.compile else ()
        draft, notes = _memory(profiler, problem, precisions, world, compiled=compiled)
    else:
        log.info("profiling copies with 3 and 4 of the %d blocks", len(problem.blocks))
        three, blocks3 = copies.copy(3)  # each copy on the device only while it is measured
        shallow = _profiler(three.to(device), problem, blocks3)
        precisions, untrainable, slow, _ = fast_precisions(
            shallow, problem.precisions, problem.sizes, device_name=problem.target.name
        )
        timed = {}  # timed on the copy of 3 blocks, not on the copy the time profile runs on
        draft3, _ = _memory(shallow, problem, precisions, world)
        del shallow, three
        backend_for(device).empty_cache()
        four, blocks4 = copies.copy(4)
        profiler = _profiler(four.to(device), problem, blocks4)
        draft, notes = _memory(profiler, problem, precisions, world)
        draft = deepen(draft3, draft, work, problem.blocks)
    # Training steps have run: the context now holds cuBLAS workspaces and the kernels
    # loaded lazily, which discover() could not see yet.
    context = max(problem.target.context_bytes, backend_for(device).context_bytes())
    draft = dataclasses.replace(
        draft,
        context_bytes=context,
        notes=(*slow, *notes, *draft.notes),
        untrainable=untrainable,
    )
    feasible = _caps(problem, draft, world)
    log.info("profiling time at micro-batch sizes up to %s", max(feasible.values()))
    sizes = [s for s in problem.sizes if s not in untrainable]
    profile = time_profile(
        profiler, draft, feasible, sizes, device_name=problem.target.name, timed=timed
    )
    if copies is not None:
        reference = "fp32" if "fp32" in profile.precisions else next(iter(profile.precisions))
        seconds, forward_s = profiler.block_times(reference, min(8, feasible[reference]))
        profile = deepen_time(profile, seconds, forward_s)
    for note in profile.notes:
        log.info("note: %s", note)
    return dataclasses.replace(profile, seconds=time.perf_counter() - t0)


def _profiler(model: nn.Module, problem: Problem, blocks: tuple[str, ...] = ()) -> Profiler:
    return Profiler(
        model,
        problem.sample,
        blocks or problem.blocks,
        device=problem.target.device,
        loss_fn=problem.loss_fn,
        foreign_bytes=problem.foreign,
    )


def _memory(
    profiler: Profiler,
    problem: Problem,
    precisions: tuple[str, ...],
    world: int,
    *,
    compiled: tuple[str, ...] = (),
) -> tuple[Profile, list[str]]:
    """The memory profile, with FSDP2's own bf16 timeline when several ranks are planned,
    and the compiled blocks' timelines of the precisions ``compiled``."""
    log.info("profiling memory on %s (%d blocks)", problem.target.name, len(profiler.blocks))
    draft, notes = memory_profile(
        profiler,
        precisions,
        problem.space.optimizers,
        device_name=problem.target.name,
        context_bytes=problem.target.context_bytes,
        transfer=measure_transfer(problem.target) if problem.offload else None,
        selective=problem.space.selective_checkpointing,
        compiled=compiled,
    )
    if world > 1:  # FSDP2 computes bf16 with bf16 parameters: their own timeline
        draft = sharded_precisions(profiler, draft, problem.space.optimizers[0])
    return draft, notes


_COMPILE_WITHIN = 1.15
"""Precisions whose eager pass takes at most this many times the fastest one's get a
compiled timeline: compiling a slower precision costs seconds and rarely wins."""


def _worth_compiling(
    precisions: tuple[str, ...], timed: dict[str, dict[int, float]]
) -> tuple[str, ...]:
    """The precisions to profile compiled: near the fastest eager one at the first size
    timed (every one where they were not all timed)."""
    seconds = {p: min(timed[p].values()) for p in precisions if timed.get(p)}
    if len(seconds) < len(precisions):
        return precisions
    best = min(seconds.values())
    return tuple(p for p in precisions if seconds[p] <= _COMPILE_WITHIN * best)


def _caps(problem: Problem, draft: Profile, world: int) -> dict[str, int]:
    """Per precision, the largest micro-batch that fits some layout and optimizer.

    Raises:
        BudgetTooSmallError: none fits.
    """
    planners = [
        problem.planner(CostModel(draft, layout), tuple(draft.precisions))
        for layout in layouts(world, draft.blocks)
    ]
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
        raise too_small(planners[0], problem.space, problem.budget, offload_helps=helps)
    return feasible
