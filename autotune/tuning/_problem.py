"""``Problem``: one tuning run's inputs, validated fast, and what follows from them on the
target (budget in bytes, blocks, micro-batch sizes, precisions the device runs)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from autotune._blocks import eager_module, resolve_blocks
from autotune._spelling import option
from autotune.config import FUSED_OPTIMIZERS, PAGED_OPTIMIZERS
from autotune.cost import micro_batch_candidates
from autotune.device import Target, backend_for, budget_bytes, discover
from autotune.errors import BudgetError, ConfigError, ProfileError, warn
from autotune.result import ModelInfo
from autotune.space import SearchSpace
from autotune.train import (
    LossFn,
    Workload,
    batch_size,
    compiled_parts,
    fingerprint,
    fused_runs,
    group_size,
    layouts_of_model,
    widest_first,
)
from autotune.tuning._options import TuneOptions

__all__ = [
    "Problem",
    "checked_model",
    "make_problem",
    "model_info",
    "per_rank_batch",
    "refuse_meta",
    "twinned",
    "uncompiled",
    "world_of",
]

log = logging.getLogger("autotune")

_MARGIN = {"cpu": 0.01, "cuda": 0.04}
"""Head-room the search keeps below the budget; verification is the final judge."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One tuning run's inputs, validated, and what follows from them on the target."""

    sample: Any
    """The user's sample batch."""
    loss_fn: LossFn | None
    target: Target
    model: ModelInfo
    """What the result records of the model: its class, structure and blocks."""
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
    headroom: float
    """The share of the budget the search keeps free (1% on the CPU, 4% on CUDA)."""
    foreign_bytes: int
    """CUDA bytes held by other tensors of the process when tuning began."""
    world: int = 1
    """Ranks of data parallelism tuned for."""
    verifiable: bool = True
    """Whether those ranks are this process group's, to verify on (else the run is
    planned in one process, not run)."""

    @property
    def compile(self) -> bool:
        """Whether compiled blocks are searched (where there are blocks)."""
        return bool(self.blocks) and self.space.compiles(self.target.device.type)

    @property
    def compile_model(self) -> bool:
        """Whether the model compiled whole is searched (in one process)."""
        return self.world == 1 and self.space.compiles_model(self.target.device.type)

    @property
    def offload(self) -> bool:
        """Whether offload is searched (and so profiled) on this device."""
        return any(self.space.offloads(self.target.device.type))

    @property
    def allocator_cap(self) -> int | None:
        """What the caching allocator may reserve while the run measures (profiling,
        compiling, verifying): the budget less the context, beyond what other tensors held
        when it began, so that the driver never sees the process above the budget.
        ``None`` (no cap) with several ranks: rank 0 profiles the model unsharded."""
        if self.world > 1:
            return None
        return self.budget - self.target.context_bytes + self.foreign_bytes

    def with_context(self, context_bytes: int) -> Problem:
        """The same run with the context measured again (after training steps)."""
        target = dataclasses.replace(self.target, context_bytes=context_bytes)
        return dataclasses.replace(self, target=target)

    def workload(self, model: nn.Module, blocks: tuple[str, ...] = ()) -> Workload:
        """The run's workload on ``model`` (the tuner's copy; with ``blocks``, a shallow
        copy's)."""
        return Workload(
            model,
            self.sample,
            self.loss_fn,
            blocks or self.blocks,
            self.target.device,
            self.foreign_bytes,
        )

    @property
    def device_type(self) -> str:
        """The target's device type."""
        return self.target.device.type


def uncompiled(model: nn.Module) -> nn.Module:
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
        warn(
            f"{where} compiled with torch.compile: autotune measures and tunes it without "
            "compilation, so the peak it predicts is the eager model's. Compiled, a model "
            "can hold less or more (0.64-1.10x the eager peak on autotune's CPU benchmark): "
            f"pass the model uncompiled with {option('SearchSpace(compile_blocks=True)')} to "
            "have its blocks compiled and measured, or train it as tuned, uncompiled.",
        )
    return eager_module(model) if isinstance(model, nn.Module) else model


def make_problem(
    model: nn.Module,
    sample_batch: Any,
    options: TuneOptions,
    target: Target | None = None,
    *,
    planned: bool = False,
) -> Problem:
    """Validate the inputs (fast, before anything runs) and set the run up on the target:
    the one way every kind of run (tuned, planned, estimated) makes its problem.

    Args:
        model: The model (a traced one, for a plan).
        sample_batch: Its sample batch.
        options: The run's options; ``options.global_batch_size`` is the global batch, the
            problem's is one rank's.
        target: Where the run measures; default :func:`~autotune.device.discover` of
            ``options.device``.
        planned: A plan's problem, for a GPU that is not here (``target`` stands for it,
            measured on the CPU's kernels): never verified, its space taken as given, its
            head-room a GPU's.
    """
    world, here = world_of(options.world_size)
    if options.storage is not None and world > 1:
        raise ConfigError("storage= is not supported with data parallelism yet; leave it out.")
    global_batch_size = per_rank_batch(options.global_batch_size, world)
    checked_model(model)
    batch_size(sample_batch)
    target = target or discover(options.device)
    budget = budget_bytes(options.budget_gb, target)
    space = options.space if planned else _as_the_device_runs(options.space, target)
    held_on = "cuda" if planned else target.device.type  # a plan's target is a GPU
    blocks = resolve_blocks(model, space.blocks) if space.checkpointing else ()
    return Problem(
        # Micro-batches cut from its start hold the widest samples: a model that pads a
        # micro-batch to its largest sample costs most then, as profiled and verified.
        sample=widest_first(sample_batch),
        loss_fn=options.loss_fn,
        target=target,
        space=space,
        blocks=blocks,
        model=model_info(model, blocks),
        sizes=micro_batch_candidates(space, global_batch_size),
        precisions=space.precisions if planned else _supported_precisions(space, target),
        global_batch_size=global_batch_size,
        budget=budget,
        limit=int(budget * (1 - _MARGIN.get(held_on, 0.04))),
        headroom=_MARGIN.get(held_on, 0.04),
        # What the allocator holds for other tensors (unused cached blocks returned first).
        foreign_bytes=0 if planned else backend_for(target.device).foreign_bytes(),
        world=world,
        verifiable=here and not planned,
    )


def model_info(model: nn.Module, blocks: Sequence[str]) -> ModelInfo:
    """What a result records of the model it was tuned for."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    classes = dict.fromkeys(type(model.get_submodule(b)).__name__ for b in blocks)
    return ModelInfo(type(model).__qualname__, fingerprint(model), n, tuple(blocks), tuple(classes))


def _as_the_device_runs(space: SearchSpace, target: Target) -> SearchSpace:
    """``space`` as ``target`` runs it: AdamW fused where the kernel runs, paged
    optimizers unpaged off CUDA, and no offload where the host's memory is the device's."""
    space = _fused_where_it_runs(_unpaged_off_cuda(space, target), target)
    if backend_for(target.device).host_is_device and any(space.offloads(target.device.type)):
        warn(
            f"offload saves nothing on {target.device}, where host memory is device memory; "
            "it is not searched.",
        )
        space = dataclasses.replace(space, offload_optimizer=False, offload_activations=False)
    return space


def checked_model(model: Any) -> None:
    """What a model must be to be measured, checked before anything runs: a module, with
    values, whose batches autotune can cut (a vision-language model's: by image).

    Raises:
        ProfileError: not a module, or on the meta device.
    """
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    refuse_meta(model)
    layouts_of_model(model)


def refuse_meta(model: nn.Module) -> None:
    """A model on the meta device has shapes and no values: nothing of it can train.

    Raises:
        ProfileError: what to do instead (build it for real, or plan it without memory).
    """
    meta = next(
        (n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None
    )
    if meta is not None:
        raise ProfileError(
            f"the model is on the meta device ({meta} has a shape and no values), so it "
            "cannot train: build it on the CPU (or load its weights) and pass that; to plan "
            "a model too large to build here, pass a function that builds it to "
            "autotune.plan_ahead(build, sample_batch, budget_gb), which holds no memory."
        )


def _supported_precisions(space: SearchSpace, target: Target) -> tuple[str, ...]:
    wanted: Sequence[str] = space.precisions
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
    warn(
        f"paged optimizers page their state through CUDA unified memory; on "
        f"{target.device} bitsandbytes runs them unpaged: tuning {twins}.",
    )
    return dataclasses.replace(space, optimizers=twinned(space.optimizers, PAGED_OPTIMIZERS))


def twinned(optimizers: Sequence[str], twins: dict[str, str]) -> tuple[str, ...]:
    """``optimizers`` with each that has a twin in ``twins`` replaced by it, once each,
    in order."""
    return tuple(dict.fromkeys(twins.get(o, o) for o in optimizers))


def _fused_where_it_runs(space: SearchSpace, target: Target) -> SearchSpace:
    """Where the device has torch's fused AdamW kernel, the space's AdamW is searched as
    it (``adamw_fused``: the same math in one kernel, faster, without the foreach
    version's temporary copies of the states), as an expert sets it by hand."""
    fused = [o for o in space.optimizers if o in FUSED_OPTIMIZERS]
    if not fused or not fused_runs(target.device):
        return space
    log.info("AdamW searched fused on %s (adamw_fused)", target.device)
    return dataclasses.replace(space, optimizers=twinned(space.optimizers, FUSED_OPTIMIZERS))


def world_of(world_size: int | None) -> tuple[int, bool]:
    """(the ranks to tune for, whether they are all here to verify on).

    Raises:
        ConfigError: ``world_size`` differs from the size of the process group this runs in.
    """
    group = group_size()
    if world_size is None:
        return group, True
    if world_size == group:
        return group, True
    if group > 1:
        raise ConfigError(
            f"world_size is {world_size} but this process group has {group} ranks; leave "
            "world_size out to tune for the group, or plan other sizes in one process."
        )
    return world_size, False


def per_rank_batch(global_batch_size: int | None, world: int) -> int | None:
    """Samples per optimizer step on each rank, the global batch kept exact.

    Raises:
        ConfigError: the global batch does not split evenly over the ranks.
    """
    if global_batch_size is None or world == 1:
        return global_batch_size
    if global_batch_size % world:
        raise ConfigError(
            f"{option('global_batch_size')} {global_batch_size} does not split over {world} "
            "ranks; "
            f"use a multiple of {world} (micro-batch x accumulation x world size)."
        )
    return global_batch_size // world
