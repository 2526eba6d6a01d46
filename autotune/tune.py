"""``autotune()``: the pipeline end to end.

target -> profile -> cost model -> Optuna search -> verification -> result (see DESIGN).
The user's model is only read (deep-copied); every measurement runs on the copy.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import batch as batching
from .blocks import resolve_blocks
from .config import Measurement, ModelInfo, TrainConfig, TrialRecord, TuneResult
from .cost import CostModel
from .errors import (
    BudgetError,
    ConfigError,
    ProfileError,
)
from .identity import fingerprint
from .loss import LossFn
from .optimizers import available, build_optimizer
from .profile import (
    PrecisionProfile,
    Profile,
    Profiler,
    TimeCurve,
    memory_profile,
    working_copy,
)
from .search import Study, largest_fitting, too_small
from .space import SearchSpace, micro_batch_candidates
from .studies import StudyStore, resolve_storage
from .target import Target, budget_bytes, discover, measure_transfer
from .verify import Measure, Verifier, choose_winner, fallback_ladder, fastest, settle

__all__ = ["autotune"]

log = logging.getLogger("autotune")

_MARGIN = {"cpu": 0.01, "cuda": 0.04}
"""Head-room the search keeps below the budget; verification is the final judge."""
_VERIFY_TOP = 3
_SATURATED_S = 0.5
_LONGEST_PASS_S = 2.0
_SLOW_PRECISION = 1.6
"""A precision this many times slower than fp32 at the same micro-batch cannot win."""


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
) -> TuneResult:
    """Find the fastest training configuration of ``model`` whose peak memory fits the budget.

    Args:
        model: The model to tune; left exactly as it was.
        sample_batch: One batch (Tensor, tuple/list or dict; batch dimension 0); batches of
            any size are made from it. Tune at the longest sequence you will train on.
        budget_gb: Device memory the training run may use, in GiB.
        loss_fn: ``loss_fn(output, batch) -> scalar``; default: see :mod:`autotune.loss`.
        global_batch_size: Samples per optimizer step, kept exact with accumulation;
            default: no accumulation, the micro-batch is the batch.
        device: Target device; default CUDA if available, else CPU.
        space: Knobs to search; default :class:`SearchSpace()`.
        n_trials: Optuna trials on the cost model (default: scaled to the space).
        timeout_s: Time limit of the Optuna study.
        seed: Seed of the study; the same profile gives the same configuration.
        storage: Where to keep the study, to resume it or share it between processes: an
            Optuna URL (``sqlite:///tune.db``, ``postgresql://...``), a ``*.journal`` file
            path (a journal file, for several processes), or another path (SQLite). The
            study keeps the profile and every verification, which are not redone.
        study_name: Name of the study in the storage; default: from the model and budget.

    Returns:
        The verified winner, its predicted and measured numbers, and fallbacks.

    Raises:
        BudgetError, BudgetTooSmallError, BatchError, LossError, BlockError, ProfileError,
        VerificationError: each with a message that says what to do.
    """
    started = time.perf_counter()
    space = space or SearchSpace()
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise ProfileError("loss_fn must be callable as loss_fn(output, batch) -> scalar tensor.")
    if global_batch_size is not None and (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, int)
        or global_batch_size <= 0
    ):
        raise ConfigError(
            f"global_batch_size must be a positive integer, got {global_batch_size!r}; pass "
            "the number of samples per optimizer step, or None for no accumulation."
        )
    for name in space.optimizers:
        if not available(name):
            build_optimizer(name, [], 0.0)  # raises the ConfigError that says what to install
    target = discover(device)
    budget = budget_bytes(budget_gb, target)
    offload = any(space.offloads(target.device.type))  # profile offload only if searched
    batching.batch_size(sample_batch)
    blocks = resolve_blocks(model, space.blocks) if space.checkpointing else ()
    sizes = micro_batch_candidates(space, global_batch_size)
    precisions = _supported_precisions(space.precisions, target)
    limit = int(budget * (1 - _MARGIN.get(target.device.type, 0.04)))
    foreign = torch.cuda.memory_allocated(target.device) if target.device.type == "cuda" else 0

    store = None
    if storage is not None:
        key = {
            "model": fingerprint(model),
            "budget_bytes": budget,
            "device": target.name,
            "global_batch_size": global_batch_size,
            "space": repr(space),
            "torch": str(torch.__version__),
        }
        name = study_name or f"autotune-{key['model']}-{budget}"
        store = StudyStore(resolve_storage(storage), name, key)

    work = working_copy(model, target.device)
    try:
        profile = store.profile() if store is not None else None
        if profile is None:
            profile = _profile(
                work,
                sample_batch,
                blocks,
                target,
                space,
                precisions,
                sizes,
                loss_fn,
                global_batch_size,
                budget,
                limit,
                foreign,
                offload,
            )
            if store is not None:
                store.save_profile(profile)
        else:
            log.info("profile read from study %s", store.name if store else "")
        cost = CostModel(profile)
        study = _study(
            cost, sizes, tuple(profile.precisions), space, global_batch_size, limit, target
        )
        log.info(
            "searching: %d micro-batch sizes x %s x %s",
            len(sizes),
            "/".join(study.precisions),
            "/".join(study.optimizers),
        )
        candidates = study.run(
            n_trials=n_trials,
            timeout_s=timeout_s,
            seed=seed,
            storage=store.storage if store else None,
            study_name=store.name if store else None,
        )
        verifier = Verifier(
            work,
            sample_batch,
            device=target.device,
            budget_bytes=budget,
            loss_fn=loss_fn,
            context_bytes=target.context_bytes,
            foreign_bytes=foreign,
        )
        measure = _measure_with(verifier, store)
        records = choose_winner(measure, candidates, top=_VERIFY_TOP)
        if store is not None:  # what other processes verified counts too
            records += [r for r in store.records() if r.config not in {x.config for x in records}]
        records = settle(verifier, records)
        chosen = fastest(records)
        fallbacks = fallback_ladder(measure, cost, study, chosen, records)
    finally:
        del work
        gc.collect()
        if target.device.type == "cuda":
            torch.cuda.empty_cache()

    assert chosen.measured is not None
    prediction = cost.predict(chosen.config)
    return TuneResult(
        config=chosen.config,
        predicted=prediction.measurement,
        measured=chosen.measured,
        budget_bytes=budget,
        target=target.info(),
        model=_model_info(model, profile.blocks),
        breakdown=prediction.breakdown,
        fallbacks=tuple(fallbacks),
        trials=tuple(records),
        tuning_s=time.perf_counter() - started,
    )


def _measure_with(verifier: Verifier, store: StudyStore | None) -> Measure:
    """Run configs for real; with a study, reuse its outcomes and claim before running."""

    def measure(config: TrainConfig, predicted: Measurement) -> TrialRecord | None:
        if store is not None:
            if (known := store.record(config)) is not None:
                return known
            if not store.claim(config):
                return None
        record = verifier.record(config, predicted)
        if store is not None:
            store.save_record(record)
        return record

    return measure


def _profile(
    work: nn.Module,
    sample: Any,
    blocks: Sequence[str],
    target: Target,
    space: SearchSpace,
    precisions: Sequence[str],
    sizes: Sequence[int],
    loss_fn: LossFn | None,
    global_batch_size: int | None,
    budget: int,
    limit: int,
    foreign: int,
    offload: bool,
) -> Profile:
    """Measure memory first (cheap, decides what fits), then time only what can fit.

    With ``offload``, host<->device bandwidth, the offloaded variant and the host step of
    each optimizer are measured too.
    """
    t0 = time.perf_counter()
    profiler = Profiler(
        work, sample, blocks, device=target.device, loss_fn=loss_fn, foreign_bytes=foreign
    )
    log.info("profiling memory on %s (%d blocks)", target.name, len(blocks))
    transfer = measure_transfer(target) if offload else None
    draft, notes = memory_profile(
        profiler,
        precisions,
        space.optimizers,
        device_name=target.name,
        context_bytes=target.context_bytes,
        transfer=transfer,
    )
    memory = draft.precisions
    study = _study(CostModel(draft), sizes, tuple(memory), space, global_batch_size, limit, target)
    caps = {
        p: max((b for o in space.optimizers if (b := largest_fitting(study, p, o))), default=None)
        for p in memory
    }
    feasible = {p: b for p, b in caps.items() if b is not None}
    if not feasible:
        raise too_small(study, space, budget)

    log.info("profiling time at micro-batch sizes up to %s", max(feasible.values()))
    probe = {p: _nearest(sizes, min(8, b)) for p, b in feasible.items()}
    reference = "fp32" if "fp32" in feasible else next(iter(feasible))
    times: dict[str, dict[int, float]] = {p: {} for p in feasible}
    times[reference][probe[reference]] = profiler.fwd_bwd_time(reference, probe[reference])
    for p in list(feasible):
        if p == reference:
            continue
        b = probe[reference] if probe[reference] <= feasible[p] else probe[p]
        times[p][b] = profiler.fwd_bwd_time(p, b)
        ref = times[reference].get(b) or profiler.fwd_bwd_time(reference, b)
        if "fp32" in feasible and times[p][b] > _SLOW_PRECISION * ref:
            notes.append(
                f"{p}: {times[p][b] / ref:.1f}x slower than fp32 on {target.name}, not searched"
            )
            del feasible[p], times[p]
    precision_profiles = {}
    for p, cap in feasible.items():
        ladder = _time_ladder(profiler, p, _ladder(sizes, cap), times[p])
        xs = tuple(sorted(times[p]))
        ckpt_points = sorted({ladder[min(1, len(ladder) - 1)], ladder[-1]}) if blocks else []
        ratios = tuple(
            profiler.fwd_bwd_time(p, b, checkpoint_all=True) / times[p][b] - 1 for b in ckpt_points
        )
        curve = TimeCurve(xs, tuple(times[p][x] for x in xs), tuple(ckpt_points), ratios)
        precision_profiles[p] = _with_time(memory[p], curve)
    weights = profiler.block_weights(reference, probe[reference]) if blocks else ()
    for note in notes:
        log.info("note: %s", note)
    return dataclasses.replace(
        draft,
        block_weights=weights,
        precisions=precision_profiles,
        seconds=time.perf_counter() - t0,
        notes=tuple(notes),
    )


def _study(
    cost: CostModel,
    sizes: Sequence[int],
    precisions: tuple[str, ...],
    space: SearchSpace,
    global_batch_size: int | None,
    limit: int,
    target: Target,
) -> Study:
    """The study of ``space`` on ``cost``; offload only where it was profiled."""
    offload_optimizer, offload_activations = space.offloads(target.device.type)
    return Study(
        cost,
        sizes,
        precisions,
        space.optimizers,
        global_batch_size,
        limit,
        space.checkpointing,
        (False, True) if offload_optimizer and cost.can_offload else (False,),
        offload_activations and cost.can_offload,
    )


def _with_time(prof: PrecisionProfile, curve: TimeCurve) -> PrecisionProfile:
    return dataclasses.replace(prof, time=curve)


def _time_ladder(
    profiler: Profiler, precision: str, ladder: list[int], times: dict[int, float]
) -> list[int]:
    """Time forward+backward up the ladder into ``times``; returns the sizes timed.

    Stops once the device is saturated (a doubling that no longer lowers the per-sample
    time by 3%, at a size whose pass takes over half a second) or a pass takes over 2 s.
    Larger sizes are then predicted at the last per-sample cost, and tuning does not
    spend minutes on them.
    """
    done: list[int] = []
    for b in ladder:
        if b not in times:
            times[b] = profiler.fwd_bwd_time(precision, b)
        done.append(b)
        if times[b] > _LONGEST_PASS_S:
            break
        if len(done) >= 3 and times[b] > _SATURATED_S:
            previous = done[-2]
            if times[b] / b > 0.97 * times[previous] / previous:
                break
    return done


def _ladder(sizes: Sequence[int], cap: int) -> list[int]:
    """Micro-batch sizes to time: about powers of two up to ``cap``, and ``cap``."""
    out, target = [], 1
    allowed = [s for s in sizes if s <= cap]
    while target <= cap:
        pick = next((s for s in allowed if s >= target), None)
        if pick is not None and pick not in out:
            out.append(pick)
        target *= 2
    if cap not in out:
        out.append(cap)
    return sorted(out)


def _nearest(sizes: Sequence[int], b: int) -> int:
    return min(sizes, key=lambda s: (abs(s - b), s))


def _supported_precisions(wanted: Sequence[str], target: Target) -> tuple[str, ...]:
    if target.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        wanted = [p for p in wanted if p != "bf16"]
    if not wanted:
        raise BudgetError(f"none of the precisions asked for runs on {target.name}.")
    return tuple(wanted)


def _model_info(model: nn.Module, blocks: Sequence[str]) -> ModelInfo:
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return ModelInfo(type(model).__qualname__, fingerprint(model), n, tuple(blocks))
