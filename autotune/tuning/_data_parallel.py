"""Tuning for data parallelism: on every rank of a process group, or planned in one
process for a world size one does not have.

Inside a process group (``torchrun``) rank 0 profiles one process's step and searches;
every rank times the group's collectives and verifies each candidate with the others, and
all take the same decisions on the same (slowest rank's, largest) measurements. Planned
in one process, the per-rank peaks and compute are predicted from the one process's
profile and nothing of the parallel run is verified: the result says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from autotune.config import TrainConfig
from autotune.errors import BudgetTooSmallError
from autotune.measure import Profile
from autotune.plan import Candidate, Planner, search
from autotune.result import ModelInfo, Spent, TuneResult
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem
from autotune.tuning._study import shared_candidates
from autotune.verify import StudyStore

__all__ = [
    "merged",
    "planned_notes",
    "planned_result",
    "search_layouts",
]
log = logging.getLogger("autotune")


def merged(found: Sequence[list[Candidate]]) -> list[Candidate]:
    """Every layout's candidates, fastest predicted first."""
    return sorted((c for cs in found for c in cs), key=Candidate.order)


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
        measured=None,  # nothing ran
        budget_bytes=problem.budget,
        target=problem.target.info(),
        model=info,
        breakdown=best.prediction.breakdown,
        tuning_s=time.perf_counter() - started,
        spent=Spent.between(clock),
        unverified=planned_notes(best.config, profile.comm is not None),
    )


def search_layouts(
    planners: list[Planner], store: StudyStore | None, options: TuneOptions
) -> list[Candidate]:
    """Every layout's candidates, fastest predicted first (each layout's searched once
    among the processes that share ``store``)."""
    n_trials, timeout_s, seed = options.n_trials, options.timeout_s, options.seed
    found = []
    for planner in planners:
        log.info(
            "searching: %d micro-batch sizes x %s x %s%s",
            len(planner.sizes),
            "/".join(planner.precisions),
            "/".join(planner.optimizers),
            _note(planner),
        )

        def run_search(planner: Planner = planner) -> list[Candidate]:
            return search(
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
