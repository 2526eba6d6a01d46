"""``Knobs``: the knobs of one configuration that the cost model reads, as one record.

The memory and time models read a configuration as its timeline (precision, compiled or
not), optimizer, micro-batch size, accumulation steps, per-block choices and optimizer
placement; a data-parallel layout is the cost model's own. A search point lacks the block
choices until the chooser solves them (:meth:`Knobs.masked` adds them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotune._profile_data import CHECKPOINT, OFFLOAD, SELECTIVE
from autotune.config import Timeline, TrainConfig

__all__ = ["Knobs", "Mask"]

Mask = tuple[int, ...]
"""Per block: KEEP, CHECKPOINT, OFFLOAD or SELECTIVE (a bool mask reads as kept or
checkpointed)."""


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """What the cost model reads of one configuration (its layout aside)."""

    timeline: Timeline
    """The profile's timeline (see :attr:`TrainConfig.timeline
    <autotune.config.TrainConfig.timeline>`)."""
    optimizer: str
    """Optimizer name."""
    micro_batch: int
    """Samples per forward/backward pass."""
    accum: int
    """Micro-batches accumulated before each optimizer step."""
    mask: Mask = ()
    """Each block's choice (see :data:`Mask`); empty where the blocks are still to be
    chosen (a model with blocks has no peak without them)."""
    offload_optimizer: bool = False
    """Whether the optimizer state and step live on the host."""

    @classmethod
    def given(
        cls,
        timeline: Timeline | str,
        optimizer: str,
        micro_batch: int,
        accum: int,
        mask: Mask = (),
        offload_optimizer: bool = False,
    ) -> Knobs:
        """The knobs given one by one, in the order of the fields (a timeline by its
        name, or an eager precision's)."""
        return cls(
            timeline=timeline if isinstance(timeline, Timeline) else Timeline.named(timeline),
            optimizer=optimizer,
            micro_batch=micro_batch,
            accum=accum,
            mask=mask,
            offload_optimizer=offload_optimizer,
        )

    @classmethod
    def of(cls, config: TrainConfig, mask: Mask) -> Knobs:
        """The knobs of ``config``, its block choices as ``mask`` (the cost model's
        :meth:`~autotune.cost._memory_model.ProfileView.config_mask` of it)."""
        return cls(
            timeline=config.timeline,
            optimizer=config.optimizer,
            micro_batch=config.micro_batch_size,
            accum=config.grad_accum_steps,
            mask=mask,
            offload_optimizer=config.offload_optimizer,
        )

    def masked(self, mask: Mask) -> Knobs:
        """These knobs with block choices ``mask``."""
        return dataclasses.replace(self, mask=mask)

    def config(self, blocks: tuple[str, ...]) -> TrainConfig:
        """The single-process configuration of these knobs over a model's ``blocks``
        (their names, in the order of the mask)."""

        def named(choice: int) -> tuple[str, ...]:
            return tuple(n for n, m in zip(blocks, self.mask, strict=True) if m == choice)

        return TrainConfig(
            micro_batch_size=self.micro_batch,
            grad_accum_steps=self.accum,
            **self.timeline.knobs(blocks),
            checkpoint=named(CHECKPOINT),
            selective_checkpoint=named(SELECTIVE),
            offload_activations=named(OFFLOAD),
            optimizer=self.optimizer,
            offload_optimizer=self.offload_optimizer,
        )
