"""Tuning for data parallelism: on every rank of a process group, or planned in one
process for a world size one does not have.

Inside a process group (``torchrun``) rank 0 profiles one process's step and searches;
every rank times the group's collectives and verifies each candidate with the others, and
all take the same decisions on the same (slowest rank's, largest) measurements. Planned
in one process, the per-rank peaks and compute are predicted from the one process's
profile and nothing of the parallel run is verified: the result says so.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from autotune._problem import Problem
from autotune._shared import shared_candidates
from autotune.config import MAX_BATCH, TrainConfig
from autotune.errors import AutotuneError, BudgetTooSmallError, ConfigError
from autotune.measure._profile_data import Profile
from autotune.plan._layout import Layout
from autotune.plan._planner import Candidate, Planner
from autotune.plan._search import search
from autotune.result import ModelInfo, Spent, TuneResult
from autotune.train._parallel import broadcast, group_size, rank
from autotune.verify._studies import StudyStore

__all__ = [
    "layouts",
    "merged",
    "per_rank_batch",
    "planned_notes",
    "planned_result",
    "planner_of",
    "rank_zero",
    "search_layouts",
    "world_of",
]

T = TypeVar("T")
log = logging.getLogger("autotune")


def world_of(world_size: int | None) -> tuple[int, bool]:
    """(the ranks to tune for, whether they are all here to verify on).

    Raises:
        ConfigError: ``world_size`` is not a positive integer, or differs from the size of
            the process group this runs in.
    """
    here = group_size()
    if world_size is None:
        return here, True
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r:.40}.")
    if world_size == here:
        return here, True
    if here > 1:
        raise ConfigError(
            f"world_size is {world_size} but this process group has {here} ranks; leave "
            "world_size out to tune for the group, or plan other sizes in one process."
        )
    return world_size, False


def per_rank_batch(global_batch_size: int | None, world: int) -> int | None:
    """Samples per optimizer step on each rank, the global batch kept exact.

    Raises:
        ConfigError: the global batch does not split evenly over the ranks.
    """
    if global_batch_size is None or world == 1:
        return global_batch_size
    if not isinstance(global_batch_size, int) or not 1 <= global_batch_size <= MAX_BATCH:
        return global_batch_size  # make_problem says what is wrong with it
    if global_batch_size % world:
        raise ConfigError(
            f"global_batch_size {global_batch_size} does not split over {world} ranks; "
            f"use a multiple of {world} (micro-batch x accumulation x world size)."
        )
    return global_batch_size // world


def layouts(world: int, blocks: Sequence[str]) -> list[Layout]:
    """The data parallelism to search: DDP; FSDP2 resharding every unit after forward;
    FSDP2 keeping the last unit gathered (its backward follows its forward: a second
    all-gather there only waits); FSDP2 keeping every unit gathered (no second all-gather)."""
    if world == 1:
        return [Layout()]
    out = [Layout("ddp", world), Layout("fsdp", world)]
    if len(blocks) > 1:
        out.append(Layout("fsdp", world, (blocks[-1],)))
    if blocks:
        out.append(Layout("fsdp", world, tuple(blocks)))
    return out


def planner_of(planners: Sequence[Planner], config: TrainConfig) -> Planner:
    """The planner whose layout ``config`` was planned under."""
    for p in planners:
        layout = p.cost.layout
        if (layout.parallel, layout.keep_gathered) == (config.parallel, config.keep_gathered):
            return p
    return planners[0]


def merged(found: Sequence[list[Candidate]]) -> list[Candidate]:
    """Every layout's candidates, fastest predicted first."""
    return sorted((c for cs in found for c in cs), key=Candidate.order)


def rank_zero(fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 and its result sent to every rank (just ``fn()`` alone); an
    :class:`AutotuneError` it raises is raised on every rank."""
    if group_size() == 1:
        return fn()
    outcome: tuple[T | None, AutotuneError | None] = (None, None)
    if rank() == 0:
        try:
            outcome = (fn(), None)
        except AutotuneError as exc:  # every rank raises what rank 0 found
            outcome = (None, exc)
    value, error = broadcast(outcome)
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]


def planned_notes(config: TrainConfig, comm_measured: bool) -> tuple[str, ...]:
    """What a result planned in one process for ``config.world_size`` ranks has not run."""
    if config.parallel == "none":
        return ()
    notes = [
        f"planned in one process for {config.world_size} ranks: the per-rank peak and "
        "compute are predicted from one process's profile, not run with "
        f"{config.parallel} on {config.world_size} ranks"
    ]
    if not comm_measured:
        notes.append(
            "the collectives' time is not in the predicted step time (no process group "
            "of this size to time them on); tune under torchrun to measure it"
        )
    return tuple(notes)


def planned_result(
    info: ModelInfo,
    problem: Problem,
    profile: Profile,
    candidates: list[Candidate],
    started: float,
    clock: list[float],
) -> TuneResult:
    """The fastest predicted configuration for a world size not here, marked unverified.

    Raises:
        BudgetTooSmallError: nothing fits on a rank.
    """
    if not candidates:
        raise BudgetTooSmallError(
            "no data-parallel configuration is predicted to fit the budget on a rank.",
            minimum_bytes=0,
            budget_bytes=problem.budget,
        )
    best = candidates[0]
    return TuneResult(
        config=best.config,
        predicted=best.prediction.measurement,
        measured=best.prediction.measurement,
        budget_bytes=problem.budget,
        target=problem.target.info(),
        model=info,
        breakdown=best.prediction.breakdown,
        tuning_s=time.perf_counter() - started,
        spent=Spent(*(b - a for a, b in itertools.pairwise(clock))),
        unverified=planned_notes(best.config, profile.comm is not None),
    )


def search_layouts(
    planners: list[Planner],
    store: StudyStore | None,
    n_trials: int | None,
    timeout_s: float | None,
    seed: int,
) -> list[Candidate]:
    """Every layout's candidates, fastest predicted first."""
    found = []
    for planner in planners:
        log.info(
            "searching: %d micro-batch sizes x %s x %s%s",
            len(planner.sizes),
            "/".join(planner.precisions),
            "/".join(planner.optimizers),
            _note(planner),
        )
        run_search = functools.partial(
            search,
            planner,
            n_trials=n_trials,
            timeout_s=timeout_s,
            seed=seed,
            storage=store.storage if store else None,
            study_name=store.name if store else None,
        )
        if store is None:
            found.append(run_search())
        else:
            found.append(
                shared_candidates(store, run_search, planner.cost, n_trials, timeout_s, seed)
            )
    return merged(found)


def _note(planner: Planner) -> str:
    layout = planner.cost.layout
    return "" if layout.parallel == "none" else f" ({layout.describe()})"
