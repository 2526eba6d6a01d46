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
from .knapsack import min_cost_choice
from .profile import Profile
from .timeline import Line, Phase

__all__ = ["CHECKPOINT", "KEEP", "OFFLOAD", "CostModel", "Mask", "Prediction"]

Mask = tuple[int, ...]
"""Per block: KEEP, CHECKPOINT or OFFLOAD (a bool mask reads as kept/checkpointed)."""


@dataclass(frozen=True)
class Prediction:
    """A predicted configuration: its numbers and its memory breakdown."""

    measurement: Measurement
    breakdown: Breakdown


KEEP, CHECKPOINT, OFFLOAD = 0, 1, 2
"""A block's choice in a mask: keep its activations, recompute them, or send them to the host."""


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

    @property
    def can_offload(self) -> bool:
        """Whether offload was profiled (transfer speeds and an offloaded variant)."""
        return self.profile.transfer is not None and all(
            len(p.moved) == self.n_blocks for p in self.profile.precisions.values()
        )

    # --- memory ------------------------------------------------------------------------

    def peak(
        self,
        precision: str,
        optimizer: str,
        b: int,
        accum: int,
        mask: Mask,
        *,
        offload_optimizer: bool = False,
    ) -> int:
        """Predicted peak device bytes."""
        return self._simulate(precision, optimizer, b, accum, mask, offload_optimizer)[0]

    def _simulate(
        self,
        precision: str,
        optimizer: str,
        b: int,
        accum: int,
        mask: Mask,
        offload_optimizer: bool = False,
    ) -> tuple[int, int, int]:
        """(device peak bytes, live peak bytes, gradient bytes at the peak)."""
        first, later = self._micro[precision]
        opt = self.profile.optimizers[optimizer]
        state = 0 if offload_optimizer else opt.state_bytes
        shares = self._variant_shares(mask)
        moved = self.profile.precisions[precision].moved
        start = float(self.profile.precisions[precision].base_bytes + state)
        # An offloaded optimizer takes each gradient off the device in the last micro-batch.
        release = _released(first) if offload_optimizer else None
        peak, live, grads = self._replay(
            first, start, b, mask, shares, moved, release if accum == 1 else None
        )
        if accum >= 2:
            top, end, grads2 = self._replay(later, live, b, mask, shares, moved, None)
            # Micro-batches 2..accum repeat micro-batch 2; a net growth would compound.
            net = end - live
            top += (accum - 2) * max(net, 0.0)
            if top > peak:
                peak, grads = top, grads2
            live += (accum - 2) * net
            if release is not None:  # the last micro-batch sends the gradients down
                top, end, grads2 = self._replay(later, live, b, mask, shares, moved, release)
                if top > peak:
                    peak, grads = top, grads2
                live = end
            else:
                live += net
        if offload_optimizer:
            live -= self.profile.grad_bytes
        elif live + opt.step_peak_bytes > peak:
            peak, grads = live + opt.step_peak_bytes, self.profile.grad_bytes
        live_peak = math.ceil(max(peak, start))
        return self.device_bytes(live_peak), live_peak, grads

    def _variant_shares(self, mask: Mask) -> tuple[float, float]:
        """Parameter shares of the checkpointed and of the offloaded blocks."""
        ckpt = sum(w for w, m in zip(self._shares, mask, strict=True) if m == CHECKPOINT)
        off = sum(w for w, m in zip(self._shares, mask, strict=True) if m == OFFLOAD)
        return ckpt, off

    @staticmethod
    def _replay(
        phases: Sequence[Phase],
        live: float,
        b: int,
        mask: Mask,
        shares: tuple[float, float],
        moved: Sequence[Line],
        release: Sequence[int] | None,
    ) -> tuple[float, float, int]:
        """Replay one micro-batch from ``live`` bytes: (peak, live after, grads at peak).

        ``release``: gradient bytes already sent to the host as each phase begins (the
        last micro-batch of an offloaded optimizer), or ``None``.
        """
        peak, grads = live, 0
        offloaded = [i for i, m in enumerate(mask) if m == OFFLOAD]
        freed = 0
        for j, ph in enumerate(phases):
            if release is not None:  # gradients leave as they are made
                live -= release[j] - freed
                freed = release[j]
            if ph.block is not None:
                v = int(mask[ph.block])
                if v == OFFLOAD and ph.key[1] == "bwd":
                    live += _restores(ph.block, offloaded, moved, b)
                rise, delta = ph.peak[v](b), ph.delta[v](b)
            else:  # between blocks: in proportion to the checkpointed and offloaded shares
                rise, delta = ph.peak[0](b), ph.delta[0](b)
                for share, v in zip(shares, (CHECKPOINT, OFFLOAD), strict=True):
                    if share:
                        rise += share * (ph.peak[v](b) - ph.peak[0](b))
                        delta += share * (ph.delta[v](b) - ph.delta[0](b))
            if live + rise > peak:
                peak, grads = live + rise, ph.grads - freed
            live += delta
        return peak, live, grads

    def device_bytes(self, live_bytes: int) -> int:
        """Live tensor bytes to device bytes (CUDA: allocator overhead and context)."""
        return int(live_bytes * self.profile.alloc_ratio) + self.profile.context_bytes

    def host_bytes(self, config: TrainConfig) -> int:
        """Host bytes offload holds at most: optimizer side and one micro-batch's activations."""
        total = 0.0
        if config.offload_optimizer:
            prof = self.profile
            total += (
                prof.param_bytes + prof.grad_bytes + prof.optimizers[config.optimizer].state_bytes
            )
        if config.offload_activations:
            moved = self.profile.precisions[config.precision].moved
            b = config.micro_batch_size
            total += sum(moved[self._index[n]](b) for n in config.offload_activations)
        return math.ceil(total)

    def mask_of(self, checkpoint: Sequence[str], offload: Sequence[str] = ()) -> Mask:
        """The mask of checkpointed and offloaded block names."""
        out = [KEEP] * self.n_blocks
        for name in checkpoint:
            out[self._index[name]] = CHECKPOINT
        for name in offload:
            out[self._index[name]] = OFFLOAD
        return tuple(out)

    def plan(
        self,
        precision: str,
        optimizer: str,
        b: int,
        accum: int,
        limit: int,
        *,
        offload_optimizer: bool = False,
        offload_activations: bool = False,
    ) -> Mask | None:
        """The mask of least added time whose peak fits ``limit``, or None.

        Each block is kept, checkpointed or (``offload_activations``) offloaded: an exact
        multiple-choice knapsack over the Pareto frontier of (bytes saved, seconds added),
        checked against the simulated peak and tightened until it fits.
        """
        return self._plan(
            precision,
            optimizer,
            b,
            accum,
            limit,
            offload_optimizer,
            offload_activations and self.can_offload,
        )

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one model per tuning run
    def _plan(
        self,
        precision: str,
        optimizer: str,
        b: int,
        accum: int,
        limit: int,
        offload_optimizer: bool,
        offload_activations: bool,
    ) -> Mask | None:
        def peak(mask: Mask) -> int:
            return self.peak(
                precision, optimizer, b, accum, mask, offload_optimizer=offload_optimizer
            )

        none: Mask = (KEEP,) * self.n_blocks
        need = peak(none) - limit
        if need <= 0:
            return none
        if not self.n_blocks:
            return None
        options = self._options(precision, b, offload_activations)
        frugal: Mask = tuple(_most_saving(o) for o in options)
        if peak(frugal) > limit:
            full: Mask = (CHECKPOINT,) * self.n_blocks
            return full if frugal != full and peak(full) <= limit else None
        for _ in range(16):
            mask = min_cost_choice(options, need)
            if mask is None:
                return frugal
            over = peak(mask) - limit
            if over <= 0:
                return mask
            need += over
        return frugal

    def _options(self, precision: str, b: int, offload: bool) -> list[list[tuple[float, float]]]:
        """Per block: (bytes saved through the forward, seconds added) of each choice."""
        prof = self.profile.precisions[precision]
        curve = prof.time
        recompute = curve.recompute(b) if curve is not None else 0.0
        saved = [[0.0, 0.0, 0.0] for _ in range(self.n_blocks)]
        for ph in prof.phases:
            if ph.key[0] == 1 and ph.block is not None and ph.key[1] == "fwd":
                for v in range(1, len(ph.delta)):
                    saved[ph.block][v] += ph.delta[0](b) - ph.delta[v](b)
        out = []
        for i in range(self.n_blocks):
            weight = self.profile.block_weights[i]
            choices = [(0.0, 0.0), (saved[i][1], weight * recompute)]
            if offload:
                choices.append((saved[i][2], self._offload_cost(precision, b, i)))
            out.append(choices)
        return out

    def _offload_cost(self, precision: str, b: int, i: int) -> float:
        """Seconds offloading block ``i`` alone adds: its copies not hidden by its compute."""
        transfer = self.profile.transfer
        assert transfer is not None
        fwd, bwd = self._block_seconds(precision, b)
        nbytes = max(self.profile.precisions[precision].moved[i](b), 0.0)
        hidden_down = fwd[i + 1] if i + 1 < self.n_blocks else 0.0
        exposed = max(nbytes / transfer.d2h_bytes_per_s - hidden_down, 0.0)
        exposed += max(nbytes / transfer.h2d_bytes_per_s - bwd[i], 0.0)
        return exposed + 1e-6  # a copy is never free: prefer keeping when memory allows

    # --- time --------------------------------------------------------------------------

    def step_s(
        self,
        precision: str,
        optimizer: str,
        b: int,
        accum: int,
        mask: Mask,
        *,
        offload_optimizer: bool = False,
    ) -> float:
        """Predicted seconds of one optimizer step."""
        curve = self.profile.precisions[precision].time
        assert curve is not None, f"precision {precision} has no time profile"
        share = sum(
            w for w, m in zip(self.profile.block_weights, mask, strict=True) if m == CHECKPOINT
        )
        micro = curve.fwd_bwd(b) + share * curve.recompute(b)
        if OFFLOAD in mask:
            micro += self._offload_stall(precision, b, mask)
        return accum * micro + self._optimizer_s(precision, optimizer, b, offload_optimizer)

    def _optimizer_s(self, precision: str, optimizer: str, b: int, offload: bool) -> float:
        opt = self.profile.optimizers[optimizer]
        transfer = self.profile.transfer
        if not offload or transfer is None or opt.host_step_s is None:
            return opt.step_s
        # Gradients go down during the last backward; what outlasts it is exposed. The
        # weights come up after the host step, before the next forward.
        _, bwd = self._block_seconds(precision, b)
        down = self.profile.grad_bytes / transfer.d2h_bytes_per_s
        up = self.profile.param_bytes / transfer.h2d_bytes_per_s
        return max(down - sum(bwd), 0.0) + opt.host_step_s + up

    def _block_seconds(self, precision: str, b: int) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of each block at micro-batch ``b``."""
        curve = self.profile.precisions[precision].time
        forward = curve.recompute(b) if curve is not None else 0.0
        fwd = [w * forward for w in self.profile.block_weights]
        return fwd, [2.0 * f for f in fwd]  # a backward costs about two forwards

    def _offload_stall(self, precision: str, b: int, mask: Mask) -> float:
        """Seconds the compute waits for copies in one micro-batch (two-stream pipeline).

        Forward: each offloaded block's copy starts when its compute ends, one copy at a
        time, and a block waits for the copies of the offloaded block two before it.
        Backward: an offloaded block's first use restores it (the top one) or finds it
        prefetched, and starts restoring the next offloaded block below.
        """
        transfer = self.profile.transfer
        assert transfer is not None
        moved = self.profile.precisions[precision].moved
        fwd, bwd = self._block_seconds(precision, b)
        size = [max(moved[i](b), 0.0) if m == OFFLOAD else 0.0 for i, m in enumerate(mask)]
        clock = copy = 0.0
        done: dict[int, float] = {}
        order: list[int] = []
        for i, m in enumerate(mask):
            if m == OFFLOAD and len(order) >= 2:
                clock = max(clock, done[order[-2]])
            clock += fwd[i]
            if m == OFFLOAD:
                copy = max(copy, clock) + size[i] / transfer.d2h_bytes_per_s
                done[i] = copy
                order.append(i)
        ready: dict[int, float] = {}
        up = 0.0
        for i in reversed(range(self.n_blocks)):
            if mask[i] == OFFLOAD:
                if i not in ready:  # the top offloaded block: nothing prefetched it
                    up = max(up, clock, copy) + size[i] / transfer.h2d_bytes_per_s
                    ready[i] = up
                below = [j for j in order if j < i]
                if below:
                    j = below[-1]
                    up = max(up, clock, copy) + size[j] / transfer.h2d_bytes_per_s
                    ready[j] = up
                clock = max(clock, ready[i])
            clock += bwd[i] + (fwd[i] if mask[i] == CHECKPOINT else 0.0)
        busy = (
            sum(fwd) + sum(bwd) + sum(f for f, m in zip(fwd, mask, strict=True) if m == CHECKPOINT)
        )
        return max(clock - busy, 0.0)

    # --- both --------------------------------------------------------------------------

    def memory(self, config: TrainConfig) -> tuple[int, Breakdown]:
        """Predicted peak device bytes of ``config`` and what holds them at the peak."""
        b, n, p, o = (
            config.micro_batch_size,
            config.grad_accum_steps,
            config.precision,
            config.optimizer,
        )
        mask = self.mask_of(config.checkpoint, config.offload_activations)
        device_peak, live_peak, grads = self._simulate(p, o, b, n, mask, config.offload_optimizer)
        prof = self.profile
        state = 0 if config.offload_optimizer else prof.optimizers[o].state_bytes
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
            self.mask_of(config.checkpoint, config.offload_activations),
            offload_optimizer=config.offload_optimizer,
        )
        return Prediction(Measurement(peak, step, config.effective_batch_size / step), breakdown)


def _most_saving(choices: Sequence[tuple[float, float]]) -> int:
    return max(range(len(choices)), key=lambda v: choices[v][0])


def _released(phases: Sequence[Phase]) -> list[int]:
    """Gradient bytes made before each phase of a micro-batch (sent down when offloaded)."""
    return [ph.grads for ph in phases]


def _restores(block: int, offloaded: Sequence[int], moved: Sequence[Line], b: int) -> float:
    """Bytes brought back to the device as offloaded ``block``'s backward begins.

    The top offloaded block restores itself; every offloaded block prefetches the next
    offloaded block below it.
    """
    total = 0.0
    if block == offloaded[-1]:
        total += moved[block](b)
    below = [j for j in offloaded if j < block]
    if below:
        total += moved[below[-1]](b)
    return max(total, 0.0)
