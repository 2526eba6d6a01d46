"""``autotune()``: the pipeline end to end, orchestration only.

target -> profile -> cost model -> Optuna search -> verification -> result (see
ARCHITECTURE.md). The user's model is only read (deep-copied); every measurement runs on
the copy.
"""

from __future__ import annotations

import contextlib
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

from autotune._attention_search import tune_attention
from autotune._backend import backend_for
from autotune._by_length import Lengths, tune_by_length
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
from autotune._problem import Problem, make_problem, uncompiled
from autotune._profiling import profile_model
from autotune._shared import (
    measure_with,
    open_store,
    shared_profile,
    shared_settle,
)
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.measure._collectives import measure_collectives
from autotune.measure._depth import whole_fits
from autotune.measure._memory_profile import working_copy
from autotune.plan._cost import CostModel
from autotune.plan._planner import Candidate, Planner
from autotune.result import ModelInfo, Spent, TrialRecord, TuneResult
from autotune.space import SearchSpace
from autotune.train._compiled import measured_compiling
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
    global_batch_tokens: int | None = None,
    sequence_lengths: Sequence[int] | None = None,
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
        global_batch_tokens: Tokens per optimizer step instead (``global_batch_size``
            samples of the sequence length): at each length, ``tokens / length`` samples,
            exact, so every length must divide it.
        sequence_lengths: Tune a table: for each of these lengths (the sample batch at
            the longest), the fastest verified config for batches padded up to it, in
            ``result.by_length``; the runner trains each batch with its length's row and
            :class:`autotune.LengthBucketSampler` makes the batches. Every row keeps the
            optimizer step's meaning (the global batch, in samples or tokens), the
            precision and the optimizer of the longest, so the math is the same.
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
        The verified winner, its predicted and measured numbers, and fallbacks (with
        ``sequence_lengths``: those of the longest, and the table).

    Raises:
        BudgetError, BudgetTooSmallError, BatchError, LossError, BlockError, ProfileError,
        VerificationError: each with a message that says what to do.
    """
    space = space or SearchSpace()
    model = uncompiled(model)
    if storage is not None and space.attention:
        raise ConfigError(
            "SearchSpace.attention is not supported with storage= yet; leave one of them out."
        )
    tune = functools.partial(
        _tune,
        budget_gb=budget_gb,
        loss_fn=loss_fn,
        device=device,
        n_trials=n_trials,
        timeout_s=timeout_s,
        seed=seed,
        storage=storage,
        study_name=study_name,
        world_size=world_size,
    )
    one = functools.partial(tune_attention, tune)  # each attention implementation, if asked
    if sequence_lengths is None and global_batch_tokens is None:
        return one(model, sample_batch, global_batch_size=global_batch_size, space=space)
    return tune_by_length(
        one,
        model,
        sample_batch,
        Lengths.of(sample_batch, sequence_lengths, global_batch_size, global_batch_tokens),
        space,
        parallel=world_size not in (None, 1) or group_size() > 1,
        storage=storage is not None,
    )


def _tune(
    model: nn.Module,
    sample_batch: Any,
    budget_gb: float,
    *,
    loss_fn: LossFn | None,
    global_batch_size: int | None,
    device: torch.device | str | None,
    space: SearchSpace,
    n_trials: int | None,
    timeout_s: float | None,
    seed: int,
    storage: str | None,
    study_name: str | None,
    world_size: int | None,
) -> TuneResult:
    """:func:`autotune` at one sequence length (the sample batch's)."""
    started = time.perf_counter()
    world, here = world_of(world_size)
    problem = make_problem(
        model,
        sample_batch,
        budget_gb,
        loss_fn=loss_fn,
        global_batch_size=per_rank_batch(global_batch_size, world),
        device=device,
        space=space,
    )
    if storage is not None and world > 1:
        raise ConfigError("storage= is not supported with data parallelism yet; leave it out.")
    store = None if storage is None else open_store(model, problem, storage, study_name)
    # In a process group only rank 0 profiles on the device; verification wraps a copy per
    # config, which puts on the device what the config says (a shard under FSDP).
    # A model too large for one device whole is profiled on shallow copies (FSDP2's case).
    host = torch.device("cpu")
    whole = whole_fits(model, problem.target.free_bytes, world)
    work = working_copy(model, problem.target.device if rank() == 0 and whole else host)
    compiling = contextlib.ExitStack()  # compiled blocks measured, where searched
    compiling.enter_context(measured_compiling(problem.compile))
    try:
        clock = [time.perf_counter()]  # the ends of profiling, search and verification
        measure_profile = functools.partial(profile_model, work, problem, world, whole=whole)
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
        compiling.close()
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
    # A fallback's peak is verified as any config's; one step times it, for the ladder's order.
    once = measure_with(verifier, store, timed=False)
    return chosen, records, fallback_ladder(once, planner, chosen, records)


def _model_info(model: nn.Module, blocks: Sequence[str]) -> ModelInfo:
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    classes = dict.fromkeys(type(model.get_submodule(b)).__name__ for b in blocks)
    return ModelInfo(type(model).__qualname__, fingerprint(model), n, tuple(blocks), tuple(classes))
