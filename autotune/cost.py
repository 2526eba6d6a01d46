"""The cost model: predicted peak device memory and step time of any configuration.

Memory replays the profiled phase timeline: micro-batch 1, micro-batch 2 repeated
``grad_accum_steps - 1`` times, then the optimizer step, each block's phases taken from
its kept or checkpointed variant, each quantity evaluated at the micro-batch size. Time
is ``accum * (fwd_bwd(b) + recompute(b) * share of checkpointed blocks) + optimizer step``.
A prediction costs tens of microseconds, so a study can try thousands.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .config import Breakdown, Measurement, TrainConfig
from .profile import Profile
from .timeline import Phase

__all__ = ["CostModel", "Prediction"]

Mask = tuple[bool, ...]


@dataclass(frozen=True)
class Prediction:
    """A predicted configuration: its numbers and its memory breakdown."""

    measurement: Measurement
    breakdown: Breakdown


class CostModel:
    """Predicts peak bytes and step time from a :class:`~autotune.profile.Profile`."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.n_blocks = len(profile.blocks)
        self._index = {name: i for i, name in enumerate(profile.blocks)}
        self._shares = profile.block_shares()
        self._micro = {
            name: (
                tuple(ph for ph in prec.phases if ph.key[0] == 1),
                tuple(ph for ph in prec.phases if ph.key[0] == 2),
            )
            for name, prec in profile.precisions.items()
        }

    # --- memory ------------------------------------------------------------------------

    def peak(self, precision: str, optimizer: str, b: int, accum: int, mask: Mask) -> int:
        """Predicted peak device bytes."""
        return self._simulate(precision, optimizer, b, accum, mask)[0]

    def _simulate(
        self, precision: str, optimizer: str, b: int, accum: int, mask: Mask
    ) -> tuple[int, int, int]:
        """(device peak bytes, live peak bytes, gradient bytes at the peak)."""
        first, later = self._micro[precision]
        opt = self.profile.optimizers[optimizer]
        share = sum(w for w, m in zip(self._shares, mask, strict=True) if m)
        start = float(self.profile.precisions[precision].base_bytes + opt.state_bytes)
        peak, live, grads = self._replay(first, start, b, mask, share)
        if accum >= 2:
            top, end, grads2 = self._replay(later, live, b, mask, share)
            # Micro-batches 2..accum repeat micro-batch 2; a net growth would compound.
            net = end - live
            top += (accum - 2) * max(net, 0.0)
            if top > peak:
                peak, grads = top, grads2
            live += (accum - 1) * net
        if live + opt.step_peak_bytes > peak:
            peak, grads = live + opt.step_peak_bytes, self.profile.grad_bytes
        live_peak = math.ceil(max(peak, start))
        return self.device_bytes(live_peak), live_peak, grads

    @staticmethod
    def _replay(
        phases: Sequence[Phase], live: float, b: int, mask: Mask, share: float
    ) -> tuple[float, float, int]:
        """Replay one micro-batch from ``live`` bytes: (peak, live after, grads at peak)."""
        peak, grads = live, 0
        for ph in phases:
            if ph.block is not None:
                v = 1 if mask[ph.block] else 0
                rise, delta = ph.peak[v](b), ph.delta[v](b)
            else:  # between blocks: in proportion to the checkpointed share
                rise = ph.peak[0](b) + share * (ph.peak[1](b) - ph.peak[0](b))
                delta = ph.delta[0](b) + share * (ph.delta[1](b) - ph.delta[0](b))
            if live + rise > peak:
                peak, grads = live + rise, ph.grads
            live += delta
        return peak, live, grads

    def device_bytes(self, live_bytes: int) -> int:
        """Live tensor bytes to device bytes (CUDA: allocator overhead and context)."""
        return int(live_bytes * self.profile.alloc_ratio) + self.profile.context_bytes

    def mask_of(self, names: Sequence[str]) -> Mask:
        """The boolean mask of a tuple of checkpointed block names."""
        chosen = {self._index[n] for n in names}
        return tuple(i in chosen for i in range(self.n_blocks))

    def plan(self, precision: str, optimizer: str, b: int, accum: int, limit: int) -> Mask | None:
        """The checkpoint mask of least recompute time whose peak fits ``limit``, or None."""
        return self._plan(precision, optimizer, b, accum, limit)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one model per tuning run
    def _plan(self, precision: str, optimizer: str, b: int, accum: int, limit: int) -> Mask | None:
        none: Mask = (False,) * self.n_blocks
        need = self.peak(precision, optimizer, b, accum, none) - limit
        if need <= 0:
            return none
        full: Mask = (True,) * self.n_blocks
        if not self.n_blocks or self.peak(precision, optimizer, b, accum, full) > limit:
            return None
        savings = self._savings(precision, b)
        for _ in range(16):
            mask = _min_cost_cover(savings, self.profile.block_weights, need)
            if mask is None:
                return full
            over = self.peak(precision, optimizer, b, accum, mask) - limit
            if over <= 0:
                return mask
            need += over
        return full

    def _savings(self, precision: str, b: int) -> list[float]:
        """Bytes each block stops holding through the forward when checkpointed."""
        out = [0.0] * self.n_blocks
        for ph in self.profile.precisions[precision].phases:
            if ph.key[0] == 1 and ph.block is not None and ph.key[1] == "fwd":
                out[ph.block] += ph.delta[0](b) - ph.delta[1](b)
        return out

    # --- time --------------------------------------------------------------------------

    def step_s(self, precision: str, optimizer: str, b: int, accum: int, mask: Mask) -> float:
        """Predicted seconds of one optimizer step."""
        curve = self.profile.precisions[precision].time
        assert curve is not None, f"precision {precision} has no time profile"
        share = sum(w for w, m in zip(self.profile.block_weights, mask, strict=True) if m)
        micro = curve.fwd_bwd(b) + share * curve.recompute(b)
        return accum * micro + self.profile.optimizers[optimizer].step_s

    # --- both --------------------------------------------------------------------------

    def memory(self, config: TrainConfig) -> tuple[int, Breakdown]:
        """Predicted peak device bytes of ``config`` and what holds them at the peak."""
        b, n, p, o = (
            config.micro_batch_size,
            config.grad_accum_steps,
            config.precision,
            config.optimizer,
        )
        device_peak, live_peak, grads = self._simulate(p, o, b, n, self.mask_of(config.checkpoint))
        prof = self.profile
        state = prof.optimizers[o].state_bytes
        other = prof.precisions[p].base_bytes - prof.param_bytes
        acts = max(live_peak - prof.param_bytes - grads - state - other, 0)
        return device_peak, Breakdown(
            parameters=prof.param_bytes,
            gradients=grads,
            optimizer=state,
            activations=acts,
            other=device_peak - prof.param_bytes - grads - state - acts,
        )

    def predict(self, config: TrainConfig) -> Prediction:
        """Predicted peak, step time, throughput and memory breakdown of ``config``."""
        peak, breakdown = self.memory(config)
        step = self.step_s(
            config.precision,
            config.optimizer,
            config.micro_batch_size,
            config.grad_accum_steps,
            self.mask_of(config.checkpoint),
        )
        return Prediction(Measurement(peak, step, config.effective_batch_size / step), breakdown)


def _min_cost_cover(savings: Sequence[float], costs: Sequence[float], need: float) -> Mask | None:
    """Least-cost subset of items whose savings reach ``need``: exact 0/1 knapsack.

    Dynamic programming over the Pareto frontier of (savings, cost) of subsets, savings
    capped at ``need`` (any cover is as good as another). Identical items, the usual
    transformer stack, reduce to "the first k". Past ``_FRONTIER`` states the frontier is
    thinned to the cheapest state per savings bucket, which keeps covers valid.
    """
    n = len(savings)
    gains = [max(s, 0.0) for s in savings]
    if sum(gains) < need:
        return None
    if n and max(gains) - min(gains) <= 1e-9 * max(gains) and max(costs) - min(costs) <= 1e-12:
        k = min(n, math.ceil(need / gains[0])) if gains[0] > 0 else n
        return tuple(i < k for i in range(n))
    frontier: list[tuple[float, float, int]] = [(0.0, 0.0, 0)]  # (saved, cost, chosen bits)
    for i in range(n):
        if gains[i] <= 0:
            continue
        grown = [(min(s + gains[i], need), c + costs[i], bits | 1 << i) for s, c, bits in frontier]
        frontier = _pareto(frontier + grown, need)
    _, _, bits = min((e for e in frontier if e[0] >= need), key=lambda e: e[1])
    return tuple(bool(bits >> i & 1) for i in range(n))


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
