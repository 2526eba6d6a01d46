"""``Problem``: one tuning run's inputs, validated fast, and what follows from them on the
target (budget in bytes, blocks, micro-batch sizes, precisions the device runs)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune._backend import backend_for
from autotune._blocks import eager_module, resolve_blocks
from autotune.config import BITSANDBYTES_OPTIMIZERS, MAX_BATCH, PAGED_OPTIMIZERS
from autotune.errors import AutotuneWarning, BudgetError, ConfigError, ProfileError
from autotune.measure._devices import Target, budget_bytes, discover
from autotune.plan._candidates import micro_batch_candidates
from autotune.plan._cost import CostModel
from autotune.plan._planner import Planner
from autotune.space import SearchSpace
from autotune.train import _batch as batching
from autotune.train._compiled import compiled_parts
from autotune.train._loss import LossFn
from autotune.train._optimizers import available, build_optimizer

__all__ = ["Problem", "make_problem", "uncompiled"]

_MARGIN = {"cpu": 0.01, "cuda": 0.04}
"""Head-room the search keeps below the budget; verification is the final judge."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One tuning run's inputs, validated, and what follows from them on the target."""

    sample: Any
    """The user's sample batch."""
    loss_fn: LossFn | None
    target: Target
    space: SearchSpace
    blocks: tuple[str, ...]
    """The blocks that may be checkpointed or offloaded (none without checkpointing)."""
    sizes: tuple[int, ...]
    """Micro-batch sizes the search may pick, ascending."""
    precisions: tuple[str, ...]
    """The space's precisions that the device runs."""
    global_batch_size: int | None
    budget: int
    """The budget in bytes; verification holds every configuration to it."""
    limit: int
    """The budget less the search's head-room: what a prediction may reach."""
    foreign: int
    """CUDA bytes held by other tensors of the process when tuning began."""

    @property
    def compile(self) -> bool:
        """Whether compiled blocks are searched (where there are blocks)."""
        return bool(self.blocks) and self.space.compiles(self.target.device.type)

    @property
    def offload(self) -> bool:
        """Whether offload is searched (and so profiled) on this device."""
        return any(self.space.offloads(self.target.device.type))

    def with_context(self, context_bytes: int) -> Problem:
        """The same run with the context measured again (after training steps)."""
        target = dataclasses.replace(self.target, context_bytes=context_bytes)
        return dataclasses.replace(self, target=target)

    def planner(self, cost: CostModel, precisions: Sequence[str]) -> Planner:
        """The planner of this run's space on ``cost``; offload only where it was profiled."""
        offload_optimizer, offload_activations = self.space.offloads(self.target.device.type)
        optimizers = self.space.optimizers
        if cost.layout.parallel != "none":  # what data parallelism trains (see TrainConfig)
            offload_optimizer = offload_activations = False
            optimizers = tuple(o for o in optimizers if o not in BITSANDBYTES_OPTIMIZERS)
            optimizers = optimizers or ("adamw",)
            if cost.layout.parallel == "fsdp":
                precisions = [p for p in precisions if p != "fp16"] or ["fp32"]
        return Planner(
            cost=cost,
            sizes=tuple(s for s in self.sizes if s not in cost.profile.untrainable),
            precisions=tuple(precisions),
            optimizers=optimizers,
            global_batch_size=self.global_batch_size,
            limit=self.limit,
            checkpointing=self.space.checkpointing,
            selective=self.space.selective_checkpointing,
            offload_optimizer=(False, True) if offload_optimizer and cost.can_offload else (False,),
            offload_activations=offload_activations and cost.can_offload,
        )


def uncompiled(model: nn.Module, *, stacklevel: int = 3) -> nn.Module:
    """The model to measure: ``model``, or the module a ``torch.compile`` wrapper holds.

    autotune measures a model as the user passed it uncompiled (compiling its blocks is
    a knob of its own, ``SearchSpace.compile_blocks``); a model compiled with
    ``torch.compile`` (whole, or parts of it) gets a warning that says so, and the tuner's
    copies of it run eagerly (see :func:`autotune.train._compiled.decompile`).
    """
    parts = compiled_parts(model) if isinstance(model, nn.Module) else []
    if parts:
        where = (
            "the model is" if "" in parts else f"{len(parts)} of its modules ({parts[0]}, ...) are"
        )
        warnings.warn(
            f"{where} compiled with torch.compile: autotune measures and tunes it without "
            "compilation, so the peak it predicts is the eager model's. Compiled, a model "
            "can hold less or more (0.64-1.10x the eager peak on autotune's CPU benchmark): "
            "pass the model uncompiled with SearchSpace(compile_blocks=True) to have its "
            "blocks compiled and measured, or train it as tuned, uncompiled.",
            AutotuneWarning,
            stacklevel=stacklevel,
        )
    return eager_module(model) if isinstance(model, nn.Module) else model


def make_problem(
    model: nn.Module,
    sample_batch: Any,
    budget_gb: float,
    *,
    loss_fn: LossFn | None,
    global_batch_size: int | None,
    device: torch.device | str | None,
    space: SearchSpace,
) -> Problem:
    """Validate the inputs (fast, before anything runs) and set the run up on the target."""
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise ProfileError("loss_fn must be callable as loss_fn(output, batch) -> scalar tensor.")
    if global_batch_size is not None and (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, int)
        or not 1 <= global_batch_size <= MAX_BATCH
    ):
        raise ConfigError(
            f"global_batch_size must be a positive integer up to {MAX_BATCH}, got "
            f"{str(global_batch_size)[:40]}; pass the number of samples per optimizer step, "
            "or None for no accumulation."
        )
    for name in space.optimizers:
        if not available(name):
            build_optimizer(name, [], 0.0)  # raises the ConfigError that says what to install
    target = discover(device)
    budget = budget_bytes(budget_gb, target)
    space = _unpaged_off_cuda(space, target)
    if backend_for(target.device).host_is_device and any(space.offloads(target.device.type)):
        warnings.warn(
            f"offload saves nothing on {target.device}, where host memory is device memory; "
            "it is not searched.",
            AutotuneWarning,
            stacklevel=3,
        )
        space = dataclasses.replace(space, offload_optimizer=False, offload_activations=False)
    batching.batch_size(sample_batch)
    return Problem(
        sample=sample_batch,
        loss_fn=loss_fn,
        target=target,
        space=space,
        blocks=resolve_blocks(model, space.blocks) if space.checkpointing else (),
        sizes=micro_batch_candidates(space, global_batch_size),
        precisions=_supported_precisions(space.precisions, target),
        global_batch_size=global_batch_size,
        budget=budget,
        limit=int(budget * (1 - _MARGIN.get(target.device.type, 0.04))),
        # What the allocator already holds for other tensors (their blocks, cached ones).
        foreign=backend_for(target.device).reserved(),
    )


def _supported_precisions(wanted: Sequence[str], target: Target) -> tuple[str, ...]:
    if not backend_for(target.device).supports_bf16():
        wanted = [p for p in wanted if p != "bf16"]
    if not wanted:
        raise BudgetError(f"none of the precisions asked for runs on {target.name}.")
    return tuple(wanted)


def _unpaged_off_cuda(space: SearchSpace, target: Target) -> SearchSpace:
    """Off CUDA a paged optimizer is its unpaged twin (bitsandbytes pages through CUDA
    unified memory only): tune the twin, and say so."""
    paged = [o for o in space.optimizers if o in PAGED_OPTIMIZERS]
    if not paged or target.device.type == "cuda":
        return space
    twins = ", ".join(f"{o} as {PAGED_OPTIMIZERS[o]}" for o in paged)
    warnings.warn(
        f"paged optimizers page their state through CUDA unified memory; on "
        f"{target.device} bitsandbytes runs them unpaged: tuning {twins}.",
        AutotuneWarning,
        stacklevel=4,
    )
    names = dict.fromkeys(PAGED_OPTIMIZERS.get(o, o) for o in space.optimizers)
    return dataclasses.replace(space, optimizers=tuple(names))
