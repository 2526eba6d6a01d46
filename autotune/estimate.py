"""Predicted peak memory of one configuration, without tuning.

What ``accelerate estimate-memory`` does for weights, but with the activations of a real
training step and every knob (micro-batch, accumulation, precision, checkpoint mask,
optimizer): the memory profile of the tuner (a few tracked steps at micro-batch sizes 2
and 4, on a copy of the model) fed to the cost model. Nothing is timed or verified.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import batch as batching
from .blocks import find_blocks, resolve_blocks
from .config import Breakdown, TrainConfig
from .cost import CostModel
from .errors import BlockError, ConfigError, ProfileError
from .loss import LossFn
from .profile import OptimizerProfile, PrecisionProfile, Profile, Profiler, block_parameter_bytes
from .target import Target, discover

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
        ConfigError: the config offloads (not modelled yet).
        BlockError: the config checkpoints a module that is not one of the blocks.
        ProfileError: the model does not train on the sample batch, or does not fit.
    """
    config = config or TrainConfig()
    if config.offload_activations or config.offload_optimizer:
        raise ConfigError(
            "offload_activations and offload_optimizer are not modelled by the cost model "
            "yet; estimate the config without them."
        )
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    batching.batch_size(sample_batch)  # a clear BatchError before anything runs
    target = discover(device)
    names = _blocks(model, blocks, config.checkpoint)
    foreign = torch.cuda.memory_allocated(target.device) if target.device.type == "cuda" else 0
    work = _copy_to(model, target.device)
    try:
        profile = _memory_profile(work, sample_batch, names, target, config, loss_fn, foreign)
    finally:
        del work
        gc.collect()
        if target.device.type == "cuda":
            torch.cuda.empty_cache()
    return CostModel(profile).memory(config)


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
            f"the config checkpoints {', '.join(unknown)}, which are not among the model's "
            f"blocks ({', '.join(names) or 'none'}); name the blocks to use with blocks=[...]."
        )
    return names


def _memory_profile(
    work: nn.Module,
    sample: Any,
    blocks: tuple[str, ...],
    target: Target,
    config: TrainConfig,
    loss_fn: LossFn | None,
    foreign: int,
) -> Profile:
    """The tuner's memory profile of one precision and one optimizer (no time curves)."""
    profiler = Profiler(
        work, sample, blocks, device=target.device, loss_fn=loss_fn, foreign_bytes=foreign
    )
    measured: tuple[OptimizerProfile, PrecisionProfile] | None = None
    for b1, b2 in ((2, 4), (1, 2)):  # the smaller pair when the device cannot hold the first
        try:
            optimizer = profiler.optimizer(config.optimizer, b1)
            measured = optimizer, profiler.memory(config.precision, config.optimizer, b1, b2)
            break
        except torch.OutOfMemoryError:
            continue
    if measured is None:
        raise ProfileError(
            f"the model does not fit {target.name} even at micro-batch 2; "
            "use a larger device or a smaller model."
        )
    optimizer, precision = measured
    params = {id(p): p for p in work.parameters()}
    return Profile(
        target.device.type,
        blocks,
        tuple(1.0 / len(blocks) for _ in blocks),  # time shares: unused for memory
        param_bytes=sum(p.untyped_storage().nbytes() for p in params.values()),
        grad_bytes=sum(p.untyped_storage().nbytes() for p in params.values() if p.requires_grad),
        precisions={config.precision: precision},
        optimizers={config.optimizer: optimizer},
        context_bytes=target.context_bytes,
        alloc_ratio=precision.alloc_ratio,
        block_bytes=block_parameter_bytes(work, blocks),
    )


def _copy_to(model: nn.Module, device: torch.device) -> nn.Module:
    try:
        work = copy.deepcopy(model)
    except Exception as exc:
        raise ProfileError(
            f"estimating works on a copy of the model and copy.deepcopy failed: {exc}. "
            "Make the model deep-copyable (e.g. drop non-picklable attributes)."
        ) from exc
    return work.to(device)
