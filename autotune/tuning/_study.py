"""A tuning run kept in a study: each of its expensive jobs done once among processes.

With ``storage``, :func:`autotune.autotune` profiles, searches, verifies each candidate and
re-times the contenders as jobs of a :class:`~autotune.verify._studies.StudyStore`: the
first process to claim a job does it and saves its result; the others (now, or a run
resumed later) read it. Every process thus decides from the same profile, candidates and
timings, and ends with the same winner and fallbacks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autotune._plain_data import from_plain, to_plain
from autotune._version import __version__
from autotune.config import TrainConfig
from autotune.measure import Profile, profile_from_json, profile_to_json
from autotune.plan import Candidate, CostModel
from autotune.result import Measurement, TrialRecord
from autotune.train import fingerprint
from autotune.tuning._problem import Problem
from autotune.verify import (
    PROFILE_JOB,
    Measure,
    Noise,
    StudyStore,
    Verifier,
    job_id,
    resolve_storage,
    settle,
)

__all__ = ["measure_with", "open_store", "shared_candidates", "shared_profile", "shared_settle"]


def open_store(
    model: nn.Module, problem: Problem, storage: str, study_name: str | None
) -> StudyStore:
    """The study kept in ``storage`` for this run (made for this release, model, budget
    and space; the default name says so, so another release starts a study of its own)."""
    key = {
        "autotune": __version__,
        "model": fingerprint(model),
        "budget_bytes": problem.budget,
        "device": problem.target.name,
        "global_batch_size": problem.global_batch_size,
        "space": repr(problem.space),
        "torch": str(torch.__version__),
    }
    name = study_name or f"autotune-{job_id(json.dumps(key, sort_keys=True))[:16]}"
    return StudyStore(resolve_storage(storage), name, key)


def shared_profile(store: StudyStore, measure: Callable[[], Profile]) -> Profile:
    """The study's profile, measured here if no process has (or is measuring it)."""
    text = store.once(PROFILE_JOB, lambda: profile_to_json(measure()), "profiling the model")
    return profile_from_json(text)


def shared_candidates(
    store: StudyStore, search: Callable[[], list[Candidate]], cost: CostModel, *knobs: Any
) -> list[Candidate]:
    """The study's candidates for these search ``knobs``, searched here if no process has."""
    job = job_id("search", *map(str, knobs))
    plain = store.once(job, lambda: [to_plain(c.config) for c in search()], "searching")
    return [Candidate(c, cost.predict(c)) for c in (from_plain(TrainConfig, p) for p in plain)]


def measure_with(verifier: Verifier, store: StudyStore | None, *, timed: bool = True) -> Measure:
    """Run configs for real; with a study, each once among the processes that share it.
    ``timed=False``: their speed from one step (see :meth:`Verifier.run`)."""
    kind = "verify" if timed else "verify-once"

    def measure(config: TrainConfig, predicted: Measurement) -> TrialRecord | None:
        if store is None:
            return verifier.record(config, predicted, timed=timed)
        plain = store.once(
            store.job_of(kind, config),
            lambda: to_plain(verifier.record(config, predicted, timed=timed)),
            f"verifying {config.describe()}",
        )
        record: TrialRecord = from_plain(TrialRecord, plain)
        return record

    return measure


def shared_settle(
    store: StudyStore | None, verifier: Verifier, records: list[TrialRecord], model: Noise
) -> list[TrialRecord]:
    """The contenders re-timed (see :func:`~autotune.verify._winner.settle`), once per
    set of records among the processes; a resumed run reads the timings it decided with."""
    if store is None:
        return settle(verifier, records, model)
    plain = store.once(
        store.job_of("settle", *(r.config for r in records)),
        lambda: [to_plain(r) for r in settle(verifier, records, model)],
        "re-timing the contenders",
    )
    return [from_plain(TrialRecord, p) for p in plain]
