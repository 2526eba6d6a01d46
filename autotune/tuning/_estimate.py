"""Predicted peak memory of one configuration, without tuning.

What ``accelerate estimate-memory`` does for weights, but with the activations of a real
training step and every knob (micro-batch, accumulation, precision, checkpoint mask,
optimizer): the memory profile of the tuner (a few tracked steps at micro-batch sizes 2
and 4, on a copy of the model) fed to the cost model. Nothing is timed or verified.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autotune._blocks import find_blocks, resolve_blocks
from autotune._profile_data import Profile, Transfer
from autotune.config import TrainConfig, is_factory
from autotune.cost import CostModel
from autotune.device import Target, backend_for, discover
from autotune.errors import BlockError
from autotune.measure import (
    Profiler,
    measure_transfer,
    memory_profile,
    whole_fits,
    working_copy,
)
from autotune.result import Breakdown, Costs
from autotune.train import (
    LossFn,
    OptimizerFactory,
    Workload,
    available,
    batch_size,
    factory_name,
    measured_compiling,
    not_at_hand,
    widest_first,
)
from autotune.tuning._problem import checked_model, uncompiled, world_of
from autotune.tuning._profiling import ProfiledCopies

__all__ = ["Estimate", "estimate"]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The predicted peak of one config, what holds it at the peak, and what each part
    costs. Unpacks as ``peak_bytes, at_peak`` (and ``[0]`` is the peak)."""

    peak_bytes: int
    """Predicted peak device bytes (as defined in docs/memory.md for the device)."""
    at_peak: Breakdown
    """What holds the memory at the moment of the peak (a snapshot: the gradients are 0
    when the peak comes in the first forward, before any exist)."""
    costs: Costs | None
    """What each part costs at its own most, and what grows with the micro-batch
    (``None`` with data parallelism: a rank's parts are in ``at_peak``)."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.peak_bytes, self.at_peak))

    def __getitem__(self, index: int) -> Any:
        return (self.peak_bytes, self.at_peak)[index]


def estimate(
    model: nn.Module,
    sample_batch: Any,
    config: TrainConfig | None = None,
    *,
    device: torch.device | str | None = None,
    loss_fn: LossFn | None = None,
    blocks: Sequence[str] | None = None,
    optimizer: OptimizerFactory | str | None = None,
) -> Estimate:
    """Predict the peak device memory of training ``model`` with ``config``.

    Args:
        model: The model; left as it was (the measurements run on a copy).
        sample_batch: One batch, as for :func:`autotune.autotune`.
        config: The knobs; default ``TrainConfig()`` (micro-batch 1, fp32, AdamW).
        device: Where the memory is predicted; default CUDA if available, else CPU.
        loss_fn: ``loss_fn(output, batch) -> scalar``, or ``None``.
        blocks: Qualified names of the blocks; default :func:`autotune.find_blocks`.
        optimizer: Your optimizer factory, or its import path (as for
            :func:`autotune.autotune`): in the config's place, its state and step measured.

    Returns:
        The predicted peak bytes (as defined in docs/memory.md for the device), what holds
        them at the peak, and what each part costs (``peak, at_peak = estimate(...)``).

    Raises:
        BlockError: the config checkpoints or offloads a module that is not one of the blocks.
        ProfileError: the model does not train on the sample batch, or does not fit.
    """
    config = config or TrainConfig()
    if optimizer is not None:
        config = config.replace(optimizer=factory_name(optimizer))
    elif is_factory(config.optimizer) and not available(config.optimizer):
        raise not_at_hand(config.optimizer)  # a path read from a file is never imported
    model = uncompiled(model)  # a non-module passes through, for the check below
    checked_model(model)
    batch_size(sample_batch)  # a batch autotune cannot cut: said before anything runs
    world_of(config.world_size)  # a world size this process group is not: said now
    target = discover(device)
    wrapped = (*config.checkpoint, *config.selective_checkpoint, *config.offload_activations)
    names = _compiled_all_or_none(config, _blocks(model, blocks, wrapped))
    # Micro-batches cut from the sample's start hold its widest samples, as tuning cuts them.
    sample = widest_first(sample_batch)
    foreign = backend_for(target.device).foreign_bytes()
    work = Workload(model, sample, loss_fn, names, target.device, foreign)
    cost = CostModel(_profile(work, config, target))
    peak, at_peak = cost.memory(config)
    return Estimate(peak, at_peak, cost.costs(config) if config.parallel == "none" else None)


def _profile(work: Workload, config: TrainConfig, target: Target) -> Profile:
    """The memory profile of ``config``'s timeline and optimizer, on a copy of the model,
    or on copies of 3 and 4 of its blocks where a model sharded over ranks does not fit
    the device whole."""
    model = work.model
    pieces = ProfiledCopies(
        model,
        work.blocks,
        fits=whole_fits(model, target.free_bytes, config.world_size),
        device=target.device,
        whole=lambda: working_copy(model, target.device),
    )
    offloads = bool(config.offload_activations or config.offload_optimizer)
    transfer = measure_transfer(target) if offloads else None
    profiles = []
    with measured_compiling(config.compile_level != "none" and not pieces.shallow):
        for piece, piece_blocks in pieces.each():
            profiles.append(_memory(work.over(piece, piece_blocks), config, target, transfer))
            del piece  # off the device before the next piece comes on
    profile = pieces.deepened(*profiles) if pieces.shallow else profiles[0]
    # One config, trained without fallbacks: no copy of the buffers a step writes.
    return dataclasses.replace(profile, context_bytes=target.context_now(), snapshot_bytes=0)


def _memory(
    work: Workload, config: TrainConfig, target: Target, transfer: Transfer | None
) -> Profile:
    """The memory profile of ``config``'s timeline and optimizer, measured on ``work``."""
    work.model.to(target.device)
    profiler = Profiler.of(work)
    try:
        profile, _ = memory_profile(
            profiler,
            (config.timeline,),
            (config.optimizer,),
            device_name=target.name,
            context_bytes=target.context_bytes,
            transfer=transfer,
            selective=bool(config.selective_checkpoint),
            sharded=config.parallel == "fsdp",
        )
        return profile
    finally:
        del work, profiler
        gc.collect()
        backend_for(target.device).empty_cache()


def _compiled_all_or_none(config: TrainConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names``, where ``config`` compiles every block or none.

    Raises:
        BlockError: it compiles some of them.
    """
    if config.compile_blocks and set(config.compile_blocks) != set(names):
        raise BlockError(
            f"the config compiles {len(config.compile_blocks)} blocks of {len(names)}; autotune "
            "predicts every block compiled, or none: compile_blocks must name the blocks "
            f"({', '.join(names) or 'none'})."
        )
    return names


def _blocks(
    model: nn.Module, blocks: Sequence[str] | None, checkpoint: Sequence[str]
) -> tuple[str, ...]:
    """The blocks to profile; every checkpointed name must be one of them."""
    if blocks is not None:
        names = resolve_blocks(model, blocks)
    else:
        try:
            names = find_blocks(model)
        except BlockError:
            if not checkpoint:
                return ()  # nothing to checkpoint: the whole model is one piece
            names = resolve_blocks(model, checkpoint)
    unknown = [n for n in checkpoint if n not in names]
    if unknown:
        raise BlockError(
            f"the config checkpoints or offloads {', '.join(unknown)}, which are not among the "
            "model's "
            f"blocks ({', '.join(names) or 'none'}); name the blocks to use with blocks=[...]."
        )
    return names
