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
from collections.abc import Sequence
from dataclasses import dataclass

from autotune._plain_data import from_plain, to_plain
from autotune._profile_data import Profile
from autotune.config import TrainConfig
from autotune.cost import Candidate, Chooser, CostModel, choosers, search
from autotune.errors import BudgetTooSmallError
from autotune.jobs import Codec, JobStore, job_id
from autotune.result import TuneResult
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem

__all__ = [
    "Shortlist",
    "merged",
    "planned_notes",
    "planned_result",
    "shortlist",
]
log = logging.getLogger("autotune")


@dataclass(frozen=True)
class Shortlist:
    """What the search keeps: each layout's chooser, and their candidates, fastest
    predicted first."""

    choosers: list[Chooser]
    candidates: list[Candidate]


def shortlist(
    problem: Problem, profile: Profile, options: TuneOptions, jobs: JobStore
) -> Shortlist:
    """The search of a tuning run and a plan: a chooser per layout of the problem's ranks,
    and the candidates of each searched once among ``jobs``' processes."""
    layouts = choosers(profile, problem, problem.world)
    return Shortlist(layouts, _search_layouts(layouts, jobs, options))


def merged(per_layout: Sequence[list[Candidate]]) -> list[Candidate]:
    """Every layout's candidates, fastest predicted first."""
    return sorted((c for cs in per_layout for c in cs), key=Candidate.order)


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
    problem: Problem,
    profile: Profile,
    candidates: list[Candidate],
) -> TuneResult:
    """The fastest predicted configuration for a world size not here (or a GPU not here),
    marked unverified.

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
        model=problem.model,
        breakdown=best.prediction.breakdown,
        unverified=planned_notes(best.config, profile.comm is not None),
    )


def _search_layouts(
    layouts: list[Chooser], jobs: JobStore, options: TuneOptions
) -> list[Candidate]:
    """Every layout's candidates, fastest predicted first (each layout searched once
    among the processes that share ``jobs``)."""
    n_trials, timeout_s, seed = options.n_trials, options.timeout_s, options.seed
    per_layout = []
    for chooser in layouts:
        log.info(
            "searching: %d micro-batch sizes x %s x %s%s",
            len(chooser.sizes),
            "/".join(map(str, chooser.timelines)),
            "/".join(chooser.optimizers),
            _note(chooser),
        )

        def run_search(chooser: Chooser = chooser) -> list[Candidate]:
            return search(
                chooser,
                n_trials=n_trials,
                timeout_s=timeout_s,
                seed=seed,
                storage=jobs.storage,
                study_name=jobs.name,
            )

        layout = chooser.cost.layout.describe()
        job = job_id("search", layout, *map(str, (n_trials, timeout_s, seed)))
        per_layout.append(jobs.once(job, run_search, "searching", _candidates(chooser.cost)))
    return merged(per_layout)


def _candidates(cost: CostModel) -> Codec:
    """Candidates kept as their configs, predicted again when read."""
    return Codec(
        lambda found: [to_plain(c.config) for c in found],
        lambda plain: [
            Candidate(c, cost.predict(c)) for c in (from_plain(TrainConfig, p) for p in plain)
        ],
    )


def _note(chooser: Chooser) -> str:
    layout = chooser.cost.layout
    return "" if layout.parallel == "none" else f" ({layout.describe()})"
