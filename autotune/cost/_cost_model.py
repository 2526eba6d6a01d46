"""The cost model: predicted peak device memory and step time of any configuration, and
the cheapest block choices that fit a limit.

A prediction costs tens of microseconds, so a study can try thousands. Memory comes from
:mod:`~autotune.cost._memory_model`, time from :mod:`~autotune.cost._time_model`; the
per-block choice (kept, checkpointed, checkpointed selectively or offloaded) is an exact
knapsack over both.

Exact multiple-choice knapsack: one choice per block, least added time, enough bytes saved.

Used by :meth:`autotune.cost._cost_model.CostModel.plan` to choose, per block, between keeping,
checkpointing and offloading.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotune._profile_data import Profile
from autotune.config import Timeline, TrainConfig
from autotune.cost._knobs import Knobs, Mask
from autotune.cost._memory_model import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE, MemoryModel
from autotune.cost._sharded import (
    Layout,
    comm_seconds,
    parallel_step_s,
    per_rank_peak,
    sharded_memory,
)
from autotune.cost._time_model import TimeModel
from autotune.result import Breakdown, Measurement

__all__ = [
    "CHECKPOINT",
    "KEEP",
    "OFFLOAD",
    "SELECTIVE",
    "CostModel",
    "Mask",
    "Prediction",
    "min_cost_choice",
    "min_cost_cover",
]


@dataclass(frozen=True)
class Prediction:
    """A predicted configuration: its numbers and its memory breakdown."""

    measurement: Measurement
    breakdown: Breakdown


class CostModel(MemoryModel, TimeModel):
    """Predicts peak bytes and step time from a :class:`~autotune._profile_data.Profile`.

    With a data-parallel ``layout``, :meth:`peak_of` and :meth:`fitting_mask` are per rank under
    it.
    """

    def __init__(self, profile: Profile, layout: Layout | None = None) -> None:
        super().__init__(profile)
        self.layout = layout or Layout()

    def peak_of(self, knobs: Knobs) -> int:
        """Predicted peak device bytes of ``knobs`` (of one rank under the layout)."""
        if self.layout.parallel == "none":
            return super().peak_of(knobs)
        return per_rank_peak(self, self.layout, knobs)[0]

    @property
    def can_offload(self) -> bool:
        """Whether offload was profiled (transfer speeds and an offloaded variant)."""
        return self.profile.transfer is not None and all(
            len(p.moved) == self.n_blocks
            for key, p in self.profile.precisions.items()
            if not key.compiled  # a compiled block is never offloaded
        )

    def can_select(self, timeline: Timeline) -> bool:
        """Whether blocks may be checkpointed selectively at ``precision``: its variant
        profiled, in memory and in time (under FSDP2's bf16, in its own timeline too)."""
        prof = self.profile.precisions[timeline]
        timed = prof.time is not None and bool(prof.time.selective_ratio)
        sharded = self.profile.sharded.get(timeline) if self.layout.parallel == "fsdp" else None
        return prof.selective and timed and (sharded is None or sharded.selective)

    def fitting_mask(
        self,
        knobs: Knobs,
        limit: int,
        *,
        offload_activations: bool = False,
        selective: bool = True,
    ) -> Mask | None:
        """The mask of least added time whose peak fits ``limit`` with ``knobs`` (their own
        mask aside), or None.

        Each block is kept, checkpointed, (``selective``, where profiled) checkpointed
        selectively or (``offload_activations``) offloaded: an exact multiple-choice
        knapsack over the Pareto frontier of (bytes saved, seconds added), checked against
        the simulated peak and tightened until it fits.
        """
        timeline = knobs.timeline
        return self._mask(
            knobs.masked(()),  # one cache entry whatever mask they came with
            limit,
            offload_activations and self.can_offload and not timeline.compiled,
            selective and self.can_select(timeline),
        )

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one model per tuning run
    def _mask(
        self, knobs: Knobs, limit: int, offload_activations: bool, selective: bool
    ) -> Mask | None:
        def peak(mask: Mask) -> int:
            return self.peak_of(knobs.masked(mask))

        none: Mask = (KEEP,) * self.n_blocks
        need = peak(none) - limit
        if need <= 0:
            return none
        if not self.n_blocks:
            return None
        options = self._options(knobs.timeline, knobs.micro_batch, offload_activations, selective)
        frugal: Mask = tuple(_most_saving(o) for o in options)
        if peak(frugal) > limit:
            full: Mask = (CHECKPOINT,) * self.n_blocks
            return full if frugal != full and peak(full) <= limit else None
        found = frugal
        for _ in range(16):
            mask = min_cost_choice(options, need)
            if mask is None:
                break
            over = peak(mask) - limit
            if over <= 0:
                found = mask
                break
            need += over
        return _relaxed(found, options, lambda m: peak(m) <= limit)

    def _options(
        self, timeline: Timeline, micro_batch: int, offload: bool, selective: bool
    ) -> list[list[tuple[float, float]]]:
        """Per block: (bytes saved through the forward, seconds added) of each choice, at
        the index of its mask value; a choice not allowed saves nothing."""
        prof = self.profile.precisions[timeline]
        curve = prof.time
        recompute = curve.recompute(micro_batch) if curve is not None else 0.0
        partial = curve.selective(micro_batch) if curve is not None else 0.0
        saved = [[0.0] * (SELECTIVE + 1) for _ in range(self.n_blocks)]
        for ph in prof.phases:
            if ph.key.micro == 1 and ph.block is not None and ph.key.label == "fwd":
                for v in range(1, len(ph.delta)):
                    saved[ph.block][v] += ph.delta[KEEP](micro_batch) - ph.delta[v](micro_batch)
        out = []
        for i in range(self.n_blocks):
            weight = self.profile.block_weights[i]
            choices = [(0.0, 0.0), (saved[i][CHECKPOINT], weight * recompute)]
            if offload or selective:
                off = self.offload_cost(timeline, micro_batch, i) if offload else 0.0
                choices.append((saved[i][OFFLOAD] if offload else 0.0, off))
            if selective:
                choices.append((saved[i][SELECTIVE], weight * partial))
            out.append(choices)
        return out

    def memory(self, config: TrainConfig) -> tuple[int, Breakdown]:
        """Predicted peak device bytes of ``config`` (of one rank, with data parallelism)
        and what holds them at the peak."""
        if config.parallel != "none":
            return sharded_memory(self, config)
        return super().memory(config)

    def predict(self, config: TrainConfig) -> Prediction:
        """Predicted peak, step time, throughput and memory breakdown of ``config`` (per
        rank with data parallelism; throughput over all ranks)."""
        peak, breakdown = self.memory(config)
        step = self.step_s_of(self.knobs(config))
        if config.parallel == "fsdp":  # the optimizer steps a shard
            step -= self.profile.optimizers[config.optimizer].step_s * (1 - 1 / config.world_size)
        comm = comm_seconds(self.profile, config)
        step = parallel_step_s(step, comm or 0.0, self.profile.device_type)
        return Prediction(Measurement(peak, step, config.global_batch_size / step), breakdown)


def _relaxed(
    mask: Mask, options: Sequence[Sequence[tuple[float, float]]], fits: Callable[[Mask], bool]
) -> Mask:
    """``mask`` with blocks moved to cheaper choices while it still fits.

    The knapsack counts what a block's choice saves through the forward, but the peak
    need not fall by as much: the last block's backward comes first, so checkpointing it
    recomputes its activations almost at once. Where the knapsack paid for savings that
    did not lower the peak, a block can go back to a cheaper choice; each block in turn,
    dearest first, takes the cheapest allowed choice that still fits, until none moves.
    """
    out = list(mask)
    moved = True
    while moved:
        moved = False
        for i in sorted(range(len(out)), key=lambda i: -options[i][out[i]][1]):
            cheaper = sorted(
                (cost, v)
                for v, (gain, cost) in enumerate(options[i])
                if (v == KEEP or gain > 0) and cost < options[i][out[i]][1]
            )
            for _, v in cheaper:
                trial = (*out[:i], v, *out[i + 1 :])
                if fits(trial):
                    out[i], moved = v, True
                    break
    return tuple(out)


def _most_saving(choices: Sequence[tuple[float, float]]) -> int:
    return max(range(len(choices)), key=lambda v: choices[v][0])


Choices = tuple[int, ...]


def min_cost_choice(
    options: Sequence[Sequence[tuple[float, float]]], need: float
) -> Choices | None:
    """One choice per item, least total cost, savings reaching ``need``: exact knapsack.

    ``options[i][v]`` is (savings, cost) of choice ``v`` of item ``i``; choice 0 is "do
    nothing" (0, 0). Dynamic programming over the Pareto frontier of (savings, cost),
    savings capped at ``need`` (any cover is as good as another). Identical two-choice
    items, the usual transformer stack without offload, reduce to "the first k". Past
    ``_FRONTIER`` states the frontier is thinned to the cheapest state per savings
    bucket, which keeps covers valid.
    """
    n = len(options)
    if sum(max(max(s for s, _ in o), 0.0) for o in options) < need:
        return None
    if n and all(len(o) == 2 for o in options):
        gains = [max(o[1][0], 0.0) for o in options]
        costs = [o[1][1] for o in options]
        if max(gains) - min(gains) <= 1e-9 * max(gains) and max(costs) - min(costs) <= 1e-12:
            k = min(n, math.ceil(need / gains[0])) if gains[0] > 0 else n
            return tuple(int(i < k) for i in range(n))
    frontier: list[tuple[float, float, int]] = [(0.0, 0.0, 0)]  # (saved, cost, choices)
    for i, choices in enumerate(options):
        grown = list(frontier)
        for v, (gain, cost) in enumerate(choices):
            if v and gain > 0:
                grown += [
                    (min(s + gain, need), c + cost, bits | v << 2 * i) for s, c, bits in frontier
                ]
        frontier = _pareto(grown, need)
    _, _, bits = min((e for e in frontier if e[0] >= need), key=lambda e: e[1])
    return tuple(bits >> 2 * i & 3 for i in range(n))


def min_cost_cover(savings: Sequence[float], costs: Sequence[float], need: float) -> Choices | None:
    """Least-cost subset of items whose savings reach ``need`` (two choices per item)."""
    return min_cost_choice(
        [[(0.0, 0.0), (s, c)] for s, c in zip(savings, costs, strict=True)], need
    )


_FRONTIER = 4096


def _pareto(states: list[tuple[float, float, int]], need: float) -> list[tuple[float, float, int]]:
    """Keep the states no other state beats on both savings (higher) and cost (lower)."""
    states.sort(key=lambda e: (-e[0], e[1]))
    kept: list[tuple[float, float, int]] = []
    for state in states:
        if not kept or state[1] < kept[-1][1]:
            kept.append(state)
    if len(kept) > _FRONTIER:
        buckets: dict[int, tuple[float, float, int]] = {}
        for state in kept:
            # Round savings down into a bucket: a state only ever claims less than it saves.
            key = int(state[0] / need * _FRONTIER)
            if key not in buckets or state[1] < buckets[key][1]:
                buckets[key] = state
        kept = sorted(buckets.values(), key=lambda e: -e[0])
    return kept
