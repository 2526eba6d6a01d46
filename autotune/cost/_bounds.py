"""The choosers of a tuning run: one per data-parallel layout, each bounded by the run's
space, micro-batch sizes, global batch and memory limit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from autotune._profile_data import Profile
from autotune.config import BITSANDBYTES_OPTIMIZERS, Timeline, TrainConfig
from autotune.cost._chooser import Chooser
from autotune.cost._cost_model import CostModel
from autotune.cost._sharded import Layout
from autotune.space import SearchSpace

__all__ = ["Bounds", "chooser_of", "choosers", "layouts"]


class Bounds(Protocol):
    """What bounds a run's choosers (a tuning run's ``Problem`` is one)."""

    @property
    def space(self) -> SearchSpace:
        """The knobs to search."""

    @property
    def sizes(self) -> tuple[int, ...]:
        """Micro-batch sizes the search may pick, ascending."""

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step on a rank, or ``None`` (no accumulation)."""

    @property
    def limit(self) -> int:
        """Peak device bytes a prediction may reach."""

    @property
    def device_type(self) -> str:
        """The target's device type (``cuda``, ``cpu``): what offload is allowed on."""


def layouts(world: int, blocks: Sequence[str]) -> list[Layout]:
    """The data parallelism to search: DDP; FSDP2 resharding every unit after forward;
    FSDP2 keeping the last unit gathered (its backward follows its forward: a second
    all-gather there only waits); FSDP2 keeping every unit gathered (no second all-gather)."""
    if world == 1:
        return [Layout()]
    out = [Layout("ddp", world), Layout("fsdp", world)]
    if len(blocks) > 1:
        out.append(Layout("fsdp", world, (blocks[-1],)))
    if blocks:
        out.append(Layout("fsdp", world, tuple(blocks)))
    return out


def choosers(profile: Profile, bounds: Bounds, world: int = 1) -> list[Chooser]:
    """A chooser on ``profile`` for each layout of ``world`` ranks."""
    return [
        chooser(CostModel(profile, layout), tuple(profile.precisions), bounds)
        for layout in layouts(world, profile.blocks)
    ]


def chooser(cost: CostModel, timelines: Sequence[Timeline], bounds: Bounds) -> Chooser:
    """The chooser of ``bounds``' space on ``cost``; offload only where it was profiled."""
    space = bounds.space
    offload_optimizer, offload_activations = space.offloads(bounds.device_type)
    optimizers = space.optimizers
    if cost.layout.parallel != "none":  # what data parallelism trains (see TrainConfig)
        offload_optimizer = offload_activations = False
        optimizers = tuple(o for o in optimizers if o not in BITSANDBYTES_OPTIMIZERS)
        optimizers = optimizers or ("adamw",)
        if cost.layout.parallel == "fsdp":
            timelines = [t for t in timelines if t.precision != "fp16"] or [Timeline("fp32")]
    return Chooser(
        cost=cost,
        sizes=tuple(s for s in bounds.sizes if s not in cost.profile.untrainable),
        timelines=tuple(timelines),
        optimizers=optimizers,
        global_batch_size=bounds.global_batch_size,
        limit=bounds.limit,
        checkpointing=space.checkpointing,
        selective=space.selective_checkpointing,
        offload_optimizer=(False, True) if offload_optimizer and cost.can_offload else (False,),
        offload_activations=offload_activations and cost.can_offload,
    )


def chooser_of(found: Sequence[Chooser], config: TrainConfig) -> Chooser:
    """The chooser of ``found`` whose layout ``config`` was planned under."""
    for p in found:
        layout = p.cost.layout
        if (layout.parallel, layout.keep_gathered) == (config.parallel, config.keep_gathered):
            return p
    return found[0]
