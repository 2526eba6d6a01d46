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

from autotune import __version__
from autotune._identity import fingerprint
from autotune._problem import Problem
from autotune.config import TrainConfig
from autotune.measure._profile_data import Profile
from autotune.plan._cost import CostModel
from autotune.plan._planner import Candidate
from autotune.result import Measurement, TrialRecord
from autotune.verify._claims import job_id
from autotune.verify._studies import StudyStore, resolve_storage
from autotune.verify._verifier import Verifier
from autotune.verify._winner import Measure, settle

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

    def measure_and_save() -> Profile:
        profile = measure()
        store.save_profile(profile)
        return profile

    return store.once("profile", store.profile, measure_and_save)


def shared_candidates(
    store: StudyStore, search: Callable[[], list[Candidate]], cost: CostModel, *knobs: Any
) -> list[Candidate]:
    """The study's candidates for these search ``knobs``, searched here if no process has."""
    job = job_id("search", *map(str, knobs))

    def search_and_save() -> list[TrainConfig]:
        configs = [c.config for c in search()]
        store.save_configs(job, configs)
        return configs

    configs = store.once(job, lambda: store.configs(job), search_and_save)
    return [Candidate(c, cost.predict(c)) for c in configs]


def measure_with(verifier: Verifier, store: StudyStore | None) -> Measure:
    """Run configs for real; with a study, each once among the processes that share it."""

    def measure(config: TrainConfig, predicted: Measurement) -> TrialRecord | None:
        if store is None:
            return verifier.record(config, predicted)

        def run() -> TrialRecord:
            record = verifier.record(config, predicted)
            store.save_record(record)
            return record

        return store.once(store.job_of("verify", config), lambda: store.record(config), run)

    return measure


def shared_settle(
    store: StudyStore | None, verifier: Verifier, records: list[TrialRecord]
) -> list[TrialRecord]:
    """The contenders re-timed (see :func:`~autotune.verify._winner.settle`), once per
    set of records among the processes; a resumed run reads the timings it decided with."""
    if store is None:
        return settle(verifier, records)
    job = store.job_of("settle", *(r.config for r in records))

    def settle_and_save() -> bool:
        for record in settle(verifier, records):
            store.save_record(record)
        store.set_flag(job)
        return True

    store.once(job, lambda: store.flag(job), settle_and_save)
    return [store.record(r.config) or r for r in records]
