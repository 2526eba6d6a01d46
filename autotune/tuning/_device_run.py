"""A tuning run on the device: a model at one sequence length and one attention
implementation, profiled, searched and verified (:func:`tune_on_device`, read first).

The user's model is only read (deep-copied); every measurement runs on the copy. Each
expensive stage is a job of the run's :class:`~autotune.jobs.JobStore`: in memory, or
with ``storage`` an Optuna study that processes share and a resumed run reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
from collections.abc import Iterator

import torch
from torch import nn

from autotune._format import format_bytes
from autotune._profile_data import Profile, profile_from_json, profile_to_json
from autotune._version import __version__
from autotune.config import TrainConfig
from autotune.cost import CostModel
from autotune.device import CpuClock, backend_for, busy_note
from autotune.errors import warn
from autotune.jobs import (
    Codec,
    JobStore,
    LocalJobs,
    Relayed,
    StudyStore,
    job_id,
    resolve_storage,
)
from autotune.measure import measure_collectives, whole_fits, working_copy
from autotune.result import TuneResult
from autotune.train import (
    broadcast,
    compile_artifacts,
    group_size,
    measured_compiling,
    rank,
    rank_zero,
)
from autotune.tuning._data_parallel import Shortlist, planned_result, shortlist
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem
from autotune.tuning._profiling import budget_cap, profile_model
from autotune.tuning._progress import Stopwatch
from autotune.verify import MOST_NOISE, Verification, Verifier, verification

__all__ = ["job_store", "tune_on_device"]

log = logging.getLogger("autotune")


def tune_on_device(model: nn.Module, problem: Problem, options: TuneOptions) -> TuneResult:
    """:func:`autotune.autotune` of ``problem`` (one length, one attention) on its device:
    profiled, searched and verified on the tuner's copy of ``model``, each stage timed.

    Each expensive job is done once among the processes that share the run's jobs (an
    Optuna study that processes share and a resumed run reads; rank 0's, sent to every
    rank of a process group). In a process group only rank 0 profiles on the device;
    verification wraps a copy per config, which puts on the device what the config says
    (a shard under FSDP). A model too large for one device whole is profiled on shallow
    copies (FSDP2's case).
    """
    watch, cpu = Stopwatch(), CpuClock.now()
    jobs = job_store(problem, options)  # a storage that cannot open: before any work
    leader = Relayed(jobs, rank_zero)  # profiling and search: rank 0's, sent to all
    whole = whole_fits(model, problem.target.free_bytes, problem.world)
    on_device = rank() == 0 and whole
    ends = None if options.max_tuning_s is None else watch.started + options.max_tuning_s
    if ends is not None and group_size() > 1:  # each rank's clock would decide apart
        ends = None
        warn("max_tuning_s is not applied in a process group: the ranks verify in step.")
    with _old_objects_frozen():  # before the working copy: the run's own, collected with it
        replica = working_copy(model, problem.target.device if on_device else torch.device("cpu"))
        try:
            with watch.stage("profile"), _holding(problem):
                profile = _profile(replica, problem, leader, whole)
            problem = problem.with_context(profile.context_bytes)  # after training steps
            with watch.stage("search"):
                searched = shortlist(problem, profile, options, leader)
            with watch.stage("verification"), _holding(problem):
                if problem.verifiable:
                    result = _verified(
                        replica, problem, profile, searched, jobs, options, cpu, ends
                    )
                else:  # the ranks are not here: planned
                    result = planned_result(problem, profile, searched.candidates)
        finally:
            del replica
            gc.collect()
            backend_for(problem.target.device).empty_cache()
    result = dataclasses.replace(
        result,
        tuning_s=watch.elapsed(),
        spent=watch.spent(),
        busy=_busy(cpu, result.noise) if result.measured is not None else None,
    )
    s = result.spent
    log.info(
        "tuned in %.1f s: profile %.1f s, search %.1f s, verification %.1f s",
        result.tuning_s,
        s.profile_s,
        s.search_s,
        s.verification_s,
    )
    return broadcast(result) if group_size() > 1 else result  # the same on every rank


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """The process's objects as they are now left out of garbage collection until the run
    ends (:func:`gc.freeze`): a collection after each config verified (its runner's
    cycles hold tensors) then reads what the run made, not every object of the process (a
    quarter of a second each where transformers is imported). Where the process froze
    objects of its own, they are left as they are and nothing is frozen."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def job_store(problem: Problem, options: TuneOptions) -> JobStore:
    """Where the run's jobs are done once: in memory, or the study kept in
    ``options.storage`` for this run (made for this release, model, budget and space;
    the default name says so, so another release starts a study of its own)."""
    if options.storage is None:
        return LocalJobs()
    key = {
        "autotune": __version__,
        "model": problem.model.fingerprint,
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


@contextlib.contextmanager
def _holding(problem: Problem) -> Iterator[None]:
    """The budget held from the first byte, and compiled blocks measured where searched."""
    with budget_cap(problem), measured_compiling(problem.compile or problem.compile_model):
        yield


def _profile(replica: nn.Module, problem: Problem, leader: Relayed, whole: bool) -> Profile:
    """The profile of ``replica``, measured on rank 0 (once among a study's processes), with
    the process group's collectives timed on every rank."""

    def measure() -> Profile:
        return profile_model(replica, problem, whole=whole)

    profile: Profile = leader.once("profile", measure, "profiling the model", PROFILE)
    if group_size() > 1:
        replica.to(torch.device("cpu"))
        backend_for(problem.target.device).empty_cache()
        comm = measure_collectives(problem.target.device)
        profile = dataclasses.replace(profile, comm=comm)
    return profile


def _verified(
    replica: nn.Module,
    problem: Problem,
    profile: Profile,
    searched: Shortlist,
    jobs: JobStore,
    options: TuneOptions,
    cpu: CpuClock | None,
    ends: float | None,
) -> TuneResult:
    """The best candidates run for real (:func:`~autotune.verify.verification`), and
    the verified winner with what was predicted for it and the ladder below it."""
    verifier = Verifier.of(
        problem.workload(replica), problem.budget, problem.target.context_bytes, profile.written
    )
    verified = verification(
        verifier,
        searched.choosers,
        searched.candidates,
        jobs,
        plan=options.start_from,
        started=cpu,
        eval_batch=options.eval_batch_size,
        largest_batch=problem.space.max_micro_batch_size,
        ends=ends,
    )
    chosen = verified.chosen
    assert chosen.measured is not None
    cost = verified.chooser.cost
    prediction = cost.predict(chosen.config)
    _allocator_note(cost, chosen.config)
    return TuneResult(
        config=chosen.config,
        predicted=prediction.measurement,
        measured=chosen.measured,
        budget_bytes=problem.budget,
        target=problem.target.info(),
        model=dataclasses.replace(problem.model, written=profile.written),
        breakdown=prediction.breakdown,
        fallbacks=tuple(verified.fallbacks),
        trials=tuple(verified.records),
        tied=tuple(verified.tied),
        noise=verified.noise,
        expert=verified.expert,
        expert_note=verified.expert_note,
        skipped=verified.skipped,
        compile_cache=_compile_cache(verified),
    )


def _compile_cache(verified: Verification) -> bytes:
    """The run's compiled code (:func:`~autotune.train.compile_artifacts`) where a
    verified config compiled: what the winner or a fallback the job switches to
    compiles again, out of the cache."""
    configs = [*(r.config for r in verified.records if r.measured), *verified.fallbacks]
    if not any(c.compile_level != "none" for c in configs):
        return b""
    return compile_artifacts()


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


def _busy(start: CpuClock | None, noise: float) -> str | None:
    """Whether the machine was busy while tuning, said once (see :func:`busy_note`)."""
    end = CpuClock.now()
    others = end.others_since(start) if start is not None and end is not None else None
    note = busy_note(others, noise if noise >= MOST_NOISE else None)
    if note is not None:
        log.warning("%s", note)
    return note
