"""Predicted peak memory of one configuration, without tuning.

What ``accelerate estimate-memory`` does for weights, but with the activations of a real
training step and every knob (micro-batch, accumulation, precision, checkpoint mask,
optimizer): the memory profile of the tuner (a few tracked steps at micro-batch sizes 2
and 4, on a copy of the model) fed to the cost model. Nothing is timed or verified.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autotune._backend import backend_for
from autotune._blocks import find_blocks, resolve_blocks
from autotune._problem import uncompiled
from autotune.config import TrainConfig
from autotune.errors import BlockError, ProfileError
from autotune.measure._depth import deepen, shallow_copies, whole_fits
from autotune.measure._devices import discover, measure_transfer
from autotune.measure._memory_profile import memory_profile, sharded_precisions, working_copy
from autotune.measure._profile_data import Profile
from autotune.measure._profiler import Profiler
from autotune.plan._cost import CostModel
from autotune.result import Breakdown
from autotune.train import _batch as batching
from autotune.train._compiled import measured_compiling
from autotune.train._loss import LossFn

__all__ = ["estimate"]


def estimate(
    model: nn.Module,
    sample_batch: Any,
    config: TrainConfig | None = None,
    *,
    device: torch.device | str | None = None,
    loss_fn: LossFn | None = None,
    blocks: Sequence[str] | None = None,
) -> tuple[int, Breakdown]:
    """Predict the peak device memory of training ``model`` with ``config``.

    Args:
        model: The model; left as it was (the measurements run on a copy).
        sample_batch: One batch, as for :func:`autotune.autotune`.
        config: The knobs; default ``TrainConfig()`` (micro-batch 1, fp32, AdamW).
        device: Where the memory is predicted; default CUDA if available, else CPU.
        loss_fn: ``loss_fn(output, batch) -> scalar``, or ``None``.
        blocks: Qualified names of the blocks; default :func:`autotune.find_blocks`.

    Returns:
        The predicted peak bytes (as defined in the README for the device) and what
        holds them at the peak.

    Raises:
        BlockError: the config checkpoints or offloads a module that is not one of the blocks.
        ProfileError: the model does not train on the sample batch, or does not fit.
    """
    config = config or TrainConfig()
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    model = uncompiled(model)
    batching.batch_size(sample_batch)  # a clear BatchError before anything runs
    target = discover(device)
    wrapped = (*config.checkpoint, *config.selective_checkpoint, *config.offload_activations)
    names = _blocks(model, blocks, wrapped)
    if config.compile_blocks and set(config.compile_blocks) != set(names):
        raise BlockError(
            f"the config compiles {len(config.compile_blocks)} blocks of {len(names)}; autotune "
            "predicts every block compiled, or none: compile_blocks must name the blocks "
            f"({', '.join(names) or 'none'})."
        )
    ops = backend_for(target.device)
    foreign = ops.reserved()
    offloads = bool(config.offload_activations or config.offload_optimizer)
    offload_facts = measure_transfer(target) if offloads else None

    def measured(work: nn.Module, blocks: tuple[str, ...]) -> Profile:
        work.to(target.device)
        try:
            profiler = Profiler(
                work, sample_batch, blocks, device=target.device, loss_fn=loss_fn,
                foreign_bytes=foreign,
            )  # fmt: skip
            profile, _ = memory_profile(
                profiler,
                (config.timeline,),
                (config.optimizer,),
                device_name=target.name,
                context_bytes=target.context_bytes,
                transfer=offload_facts,
                selective=bool(config.selective_checkpoint),
            )
            if config.parallel == "fsdp":
                profile = sharded_precisions(profiler, profile, config.optimizer)
            return profile
        finally:
            del work
            gc.collect()
            ops.empty_cache()

    # A model sharded over ranks may not fit the device whole: copies of 3 and 4 blocks.
    whole = whole_fits(model, target.free_bytes, config.world_size)
    copies = None if whole else shallow_copies(model, names)
    if copies is None:
        with measured_compiling(bool(config.compile_blocks)):
            profile = measured(working_copy(model, target.device), names)
    else:
        shallow = measured(*copies.copy(3))  # each copy on the device only while measured
        profile = deepen(shallow, measured(*copies.copy(4)), model, names)
    # After the profile's training steps the context holds what loads lazily too.
    context = max(target.context_bytes, ops.context_bytes())
    return CostModel(dataclasses.replace(profile, context_bytes=context)).memory(config)


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
