"""One tuning run, start to end: problem -> profile -> search -> verify -> result.

Read this file first. Every run autotune makes goes through :func:`run`:
:func:`autotune.autotune` (measured and verified on the device,
:class:`~autotune.tuning._device_run.DeviceRun`), :func:`autotune.plan_ahead` (traced for a
GPU that is not here, :class:`~autotune.tuning._plan_ahead.TracedRun`) and
:func:`autotune.estimate` (one config's peak, :class:`~autotune.tuning._estimate.OneConfig`).
They differ only in their :class:`Stages`:

* **problem**: the inputs checked and set up on the target (a context: a traced run
  holds its fake-tensor mode open while it profiles);
* **profile**: what the model costs (measured, traced, or one config's memory);
* **search**: the cost model's ranking (:func:`ranked`: every layout's chooser searched;
  an estimate predicts its one config);
* **verify**: the result from the ranking (candidates run on the device; a plan's
  winner, or its rank traced; the estimate as predicted).

What cuts across stages wraps them instead of being passed through them: the budget
held on the device (:meth:`Stages.holding`, around profiling and verification), the jobs
done once among processes (:mod:`autotune.jobs`, which a run's stages call: a kept
study's, and rank 0's for a process group, :class:`~autotune.jobs.Relayed`), and the
time spent per stage (:class:`~autotune.tuning._stopwatch.Stopwatch`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, TypeVar

from autotune._profile_data import Profile
from autotune.cost import Candidate, Chooser, choosers
from autotune.jobs import JobStore
from autotune.tuning._data_parallel import search_layouts
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem
from autotune.tuning._stopwatch import Stopwatch

__all__ = ["Ranked", "Stages", "ranked", "run"]

S = TypeVar("S")
R = TypeVar("R", covariant=True)


class Stages(Protocol[S, R]):
    """How one kind of run does each stage after its problem."""

    def profile(self, problem: Problem) -> Profile:
        """What the model costs on the target."""
        ...

    def search(self, problem: Problem, profile: Profile) -> S:
        """The cost model's ranking of what may run."""
        ...

    def verify(self, problem: Problem, profile: Profile, searched: S) -> R:
        """The run's result from the ranking."""
        ...

    def holding(self, problem: Problem) -> contextlib.AbstractContextManager[None]:
        """What holds while the run profiles and verifies (the budget on the device)."""
        ...


@dataclass(frozen=True)
class Ranked:
    """The search's ranking: each layout's chooser, and their candidates, fastest
    predicted first."""

    choosers: list[Chooser]
    candidates: list[Candidate]


def ranked(problem: Problem, profile: Profile, options: TuneOptions, jobs: JobStore) -> Ranked:
    """The search stage of a tuning run and a plan: a chooser per layout of the problem's
    ranks, and the candidates of each searched once among ``jobs``' processes."""
    found = choosers(profile, problem, problem.world)
    return Ranked(found, search_layouts(found, jobs, options))


def run(
    problem: contextlib.AbstractContextManager[Problem],
    stages: Stages[S, R],
    watch: Stopwatch,
) -> R:
    """One run: ``problem`` set up, then ``stages``, each timed on ``watch``."""
    with problem as p, watch.stage("profile"), stages.holding(p):
        profile = stages.profile(p)
    p = p.with_context(profile.context_bytes)  # after training steps: what loaded lazily
    with watch.stage("search"):
        searched = stages.search(p, profile)
    with watch.stage("verification"), stages.holding(p):
        return stages.verify(p, profile, searched)
