"""``Chooser``: what the search may choose, and the cheapest configuration that fits.

For one setting of the sampled knobs (micro-batch size, precision, optimizer, optimizer
placement) the chooser derives the rest: accumulation from the global batch, and each
block's choice (kept, checkpointed, checkpointed selectively or offloaded) solved exactly
by the cost model's knapsack, so that a search never samples block masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.config import Timeline, TrainConfig
from autotune.cost._cost_model import CHECKPOINT, KEEP, OFFLOAD, CostModel, Prediction
from autotune.cost._knobs import Knobs, Mask

__all__ = ["Candidate", "Chooser"]


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
class Chooser:
    """The knobs a search may turn over one cost model, and the limit they must fit."""

    cost: CostModel
    """The cost model of the profiled model."""
    sizes: Sequence[int]
    """Micro-batch sizes allowed, ascending."""
    timelines: Sequence[Timeline]
    """Timelines to consider (precisions, compiled or not, loss chunked or not)."""
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

    def offloads_activations(self, timeline: Timeline) -> bool:
        """Whether blocks may be offloaded at ``timeline`` (a compiled block never is: its
        saved tensors are the compiled graph's)."""
        return self.offload_activations and not timeline.compiled

    def accum(self, micro_batch: int) -> int:
        """Accumulation steps at ``micro_batch`` samples per micro-batch."""
        return self.global_batch_size // micro_batch if self.global_batch_size else 1

    def knobs(
        self, timeline: Timeline, optimizer: str, micro_batch: int, offload: bool = False
    ) -> Knobs:
        """The cost model's knobs of a setting of the sampled ones (``offload``: the
        optimizer's): accumulation derived, the block choices still to be solved."""
        return Knobs(
            timeline=timeline,
            optimizer=optimizer,
            micro_batch=micro_batch,
            accum=self.accum(micro_batch),
            offload_optimizer=offload,
        )

    def mask(self, knobs: Knobs, *, acts: bool = True) -> Mask | None:
        """The cheapest fitting block choices of ``knobs`` (``acts``: offloading blocks
        allowed where the chooser allows it), or None when nothing fits."""
        if self.checkpointing:
            return self.cost.fitting_mask(
                knobs,
                self.limit,
                offload_activations=acts and self.offloads_activations(knobs.timeline),
                selective=self.selective,
            )
        none = (KEEP,) * self.cost.n_blocks
        fits = self.cost.peak_of(knobs.masked(none))
        return none if fits <= self.limit else None

    def candidate(
        self, timeline: Timeline, optimizer: str, micro_batch: int, offload: bool = False
    ) -> Candidate | None:
        """The cheapest fitting configuration of these knobs and its prediction, or None."""
        config = self.config(timeline, optimizer, micro_batch, offload)
        return None if config is None else Candidate(config, self.cost.predict(config))

    def config(
        self, timeline: Timeline, optimizer: str, micro_batch: int, offload: bool = False
    ) -> TrainConfig | None:
        """The cheapest fitting configuration of these knobs, host memory allowing."""
        knobs = self.knobs(timeline, optimizer, micro_batch, offload)
        for acts in (True, False):  # without offloaded activations if the host is too small
            mask = self.mask(knobs, acts=acts)
            if mask is None:
                return None
            config = self.config_of(knobs.masked(mask))
            if self.host_fits(config):
                return config
            if not config.offload_activations:
                break
        return None

    def config_of(self, knobs: Knobs) -> TrainConfig:
        """The configuration of ``knobs`` (block choices included) under the layout."""
        return self.cost.layout.apply(knobs.config(self.cost.profile.blocks))

    def host_fits(self, config: TrainConfig) -> bool:
        """Whether the host memory offload would pin stays within the host's limit."""
        transfer = self.cost.profile.transfer
        if transfer is None or not (config.offload_optimizer or config.offload_activations):
            return True
        return self.cost.host_bytes(config) <= transfer.host_limit_bytes

    def frugal(self, knobs: Knobs) -> Knobs:
        """``knobs`` with every block checkpointed, or offloaded where that saves more (or
        kept: no blocks)."""
        full = knobs.masked((CHECKPOINT if self.checkpointing else KEEP,) * self.cost.n_blocks)
        if not (self.offloads_activations(knobs.timeline) and self.checkpointing):
            return full
        off = knobs.masked((OFFLOAD,) * self.cost.n_blocks)
        return off if self.cost.peak_of(off) < self.cost.peak_of(full) else full

    def frugal_peak(
        self, timeline: Timeline, optimizer: str, micro_batch: int, offload: bool
    ) -> int:
        """Predicted peak of :meth:`frugal`: the least these knobs can need."""
        return self.cost.peak_of(self.frugal(self.knobs(timeline, optimizer, micro_batch, offload)))
