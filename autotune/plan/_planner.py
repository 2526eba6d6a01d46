"""``Planner``: what the search may choose, and the cheapest configuration that fits.

For one setting of the sampled knobs (micro-batch size, precision, optimizer, optimizer
placement) the planner derives the rest: accumulation from the global batch, and each
block's choice (kept, checkpointed, checkpointed selectively or offloaded) solved exactly
by the cost model's knapsack, so that a search never samples block masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.config import TrainConfig, timeline_knobs, timeline_parts
from autotune.plan._cost import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE, CostModel, Mask, Prediction

__all__ = ["Candidate", "Planner"]


@dataclass(frozen=True)
class Candidate:
    """A configuration and its prediction."""

    config: TrainConfig
    prediction: Prediction

    def order(self) -> tuple[float, int]:
        """Sort key: the fastest predicted first, then the least memory."""
        m = self.prediction.measurement
        return -m.samples_per_s, m.peak_bytes


@dataclass(frozen=True, kw_only=True)
class Planner:
    """The knobs a search may turn over one cost model, and the limit they must fit."""

    cost: CostModel
    """The cost model of the profiled model."""
    sizes: Sequence[int]
    """Micro-batch sizes allowed, ascending."""
    precisions: Sequence[str]
    """Precisions to consider."""
    optimizers: Sequence[str]
    """Optimizers to consider; the first is the user's."""
    global_batch_size: int | None
    """Fixed samples per optimizer step, or ``None`` (no accumulation)."""
    limit: int
    """Peak device bytes a configuration may predict."""
    checkpointing: bool = True
    """Whether blocks may be checkpointed."""
    selective: bool = True
    """Whether blocks may be checkpointed selectively (where the profile has it)."""
    offload_optimizer: Sequence[bool] = (False,)
    """Optimizer placements to consider (``False``: on the device)."""
    offload_activations: bool = False
    """Whether blocks may be offloaded (needs an offload profile)."""

    def offloads_activations(self, precision: str) -> bool:
        """Whether blocks may be offloaded at timeline ``precision`` (a compiled block
        never is: its saved tensors are the compiled graph's)."""
        return self.offload_activations and not timeline_parts(precision)[1]

    def accum(self, b: int) -> int:
        """Accumulation steps at micro-batch ``b``."""
        return self.global_batch_size // b if self.global_batch_size else 1

    def mask(
        self, precision: str, optimizer: str, b: int, offload: bool = False, *, acts: bool = True
    ) -> Mask | None:
        """The cheapest fitting mask, or None when nothing fits."""
        n = self.accum(b)
        if self.checkpointing:
            return self.cost.plan(
                precision,
                optimizer,
                b,
                n,
                self.limit,
                offload_optimizer=offload,
                offload_activations=acts and self.offloads_activations(precision),
                selective=self.selective,
            )
        none = (KEEP,) * self.cost.n_blocks
        fits = self.cost.peak(precision, optimizer, b, n, none, offload_optimizer=offload)
        return none if fits <= self.limit else None

    def candidate(
        self, precision: str, optimizer: str, b: int, offload: bool = False
    ) -> Candidate | None:
        """The cheapest fitting configuration of these knobs and its prediction, or None."""
        config = self.config(precision, optimizer, b, offload)
        return None if config is None else Candidate(config, self.cost.predict(config))

    def config(
        self, precision: str, optimizer: str, b: int, offload: bool = False
    ) -> TrainConfig | None:
        """The cheapest fitting configuration of these knobs, host memory allowing."""
        for acts in (True, False):  # without offloaded activations if the host is too small
            mask = self.mask(precision, optimizer, b, offload, acts=acts)
            if mask is None:
                return None
            config = self.with_mask(precision, optimizer, b, offload, mask)
            if self.host_fits(config):
                return config
            if not config.offload_activations:
                break
        return None

    def with_mask(
        self, precision: str, optimizer: str, b: int, offload: bool, mask: Mask
    ) -> TrainConfig:
        """The configuration of these knobs with block choices ``mask``."""
        blocks = self.cost.profile.blocks

        def named(choice: int) -> tuple[str, ...]:
            return tuple(n for n, m in zip(blocks, mask, strict=True) if m == choice)

        config = TrainConfig(
            micro_batch_size=b,
            grad_accum_steps=self.accum(b),
            **timeline_knobs(precision, blocks),
            checkpoint=named(CHECKPOINT),
            selective_checkpoint=named(SELECTIVE),
            offload_activations=named(OFFLOAD),
            optimizer=optimizer,
            offload_optimizer=offload,
        )
        return self.cost.layout.apply(config)

    def host_fits(self, config: TrainConfig) -> bool:
        """Whether the host memory offload would pin stays within the host's limit."""
        transfer = self.cost.profile.transfer
        if transfer is None or not (config.offload_optimizer or config.offload_activations):
            return True
        return self.cost.host_bytes(config) <= transfer.host_limit_bytes

    def frugal_mask(self, precision: str, optimizer: str, b: int, offload: bool) -> Mask:
        """Every block checkpointed, or offloaded where that saves more (or kept: no blocks)."""
        n = self.accum(b)
        full: Mask = (CHECKPOINT if self.checkpointing else KEEP,) * self.cost.n_blocks
        if not (self.offloads_activations(precision) and self.checkpointing):
            return full
        off: Mask = (OFFLOAD,) * self.cost.n_blocks
        peak_off = self.cost.peak(precision, optimizer, b, n, off, offload_optimizer=offload)
        peak_full = self.cost.peak(precision, optimizer, b, n, full, offload_optimizer=offload)
        return off if peak_off < peak_full else full

    def frugal_peak(self, precision: str, optimizer: str, b: int, offload: bool) -> int:
        """Predicted peak of :meth:`frugal_mask`: the least these knobs can need."""
        mask = self.frugal_mask(precision, optimizer, b, offload)
        return self.cost.peak(
            precision, optimizer, b, self.accum(b), mask, offload_optimizer=offload
        )
