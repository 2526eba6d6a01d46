"""Step time of any configuration: measured forward+backward curves, recompute, the
optimizer step, and the copies of offload that compute does not hide.

``accum * (fwd_bwd(b) + recompute(b) * share of checkpointed blocks + selective(b) *
share of selectively checkpointed blocks + offload stall) + optimizer step``. Pure
arithmetic over the profile.
"""

from __future__ import annotations

from autotune.config import Timeline
from autotune.cost._knobs import Knobs
from autotune.cost._memory_model import CHECKPOINT, OFFLOAD, SELECTIVE, ProfileView

__all__ = ["TimeModel"]


class TimeModel(ProfileView):
    """Predicts seconds per optimizer step from a profile."""

    def step_s_of(self, knobs: Knobs) -> float:
        """Predicted seconds of one optimizer step of ``knobs``."""
        timeline, micro_batch, mask = knobs.timeline, knobs.micro_batch, knobs.mask
        curve = self.profile.precisions[timeline].time
        assert curve is not None, f"timeline {timeline} has no time profile"
        weights = self.profile.block_weights
        full = sum(w for w, m in zip(weights, mask, strict=True) if m == CHECKPOINT)
        selective = sum(w for w, m in zip(weights, mask, strict=True) if m == SELECTIVE)
        micro = (
            curve.fwd_bwd(micro_batch)
            + full * curve.recompute(micro_batch)
            + selective * curve.selective(micro_batch)
        )
        if OFFLOAD in mask:
            micro += self._offload_stall(knobs)
        return knobs.accum * micro + self._optimizer_s(knobs)

    def _optimizer_s(self, knobs: Knobs) -> float:
        """Seconds of the optimizer step, on the host where ``knobs`` offload it."""
        opt = self.profile.optimizers[knobs.optimizer]
        transfer = self.profile.transfer
        if not knobs.offload_optimizer or transfer is None or opt.host_step_s is None:
            return opt.step_s
        # Gradients go down during the last backward; what outlasts it is exposed. The
        # weights come up after the host step, before the next forward.
        _, bwd = self._block_seconds(knobs.timeline, knobs.micro_batch)
        down = self.profile.grad_bytes / transfer.d2h_bytes_per_s
        up = self.profile.grad_bytes / transfer.h2d_bytes_per_s  # the trained weights
        return max(down - sum(bwd), 0.0) + opt.host_step_s + up

    def _block_seconds(self, timeline: Timeline, b: int) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of each block at micro-batch ``b``."""
        curve = self.profile.precisions[timeline].time
        forward = curve.recompute(b) if curve is not None else 0.0
        fwd = [w * forward for w in self.profile.block_weights]
        return fwd, [2.0 * f for f in fwd]  # a backward costs about two forwards

    def _recomputed(self, knobs: Knobs) -> list[float]:
        """Seconds each block recomputes in its backward."""
        curve = self.profile.precisions[knobs.timeline].time
        if curve is None:
            return [0.0] * self.n_blocks
        micro_batch = knobs.micro_batch
        per = {CHECKPOINT: curve.recompute(micro_batch), SELECTIVE: curve.selective(micro_batch)}
        weights = self.profile.block_weights
        return [w * per.get(m, 0.0) for w, m in zip(weights, knobs.mask, strict=True)]

    def _offload_stall(self, knobs: Knobs) -> float:
        """Seconds the compute waits for copies in one micro-batch (two-stream pipeline).

        Forward: each offloaded block's copy starts when its compute ends, one copy at a
        time, and a block waits for the copies of the offloaded block two before it.
        Backward: an offloaded block's first use restores it (the top one) or finds it
        prefetched, and starts restoring the next offloaded block below.
        """
        transfer = self.profile.transfer
        assert transfer is not None
        mask, micro_batch = knobs.mask, knobs.micro_batch
        moved = self.profile.precisions[knobs.timeline].moved
        fwd, bwd = self._block_seconds(knobs.timeline, micro_batch)
        again = self._recomputed(knobs)
        size = [
            max(moved[i](micro_batch), 0.0) if m == OFFLOAD else 0.0 for i, m in enumerate(mask)
        ]
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
            clock += bwd[i] + again[i]
        return max(clock - sum(fwd) - sum(bwd) - sum(again), 0.0)

    def offload_cost(self, timeline: Timeline, b: int, i: int) -> float:
        """Seconds offloading block ``i`` alone adds: its copies not hidden by its compute."""
        transfer = self.profile.transfer
        assert transfer is not None
        fwd, bwd = self._block_seconds(timeline, b)
        nbytes = max(self.profile.precisions[timeline].moved[i](b), 0.0)
        hidden_down = fwd[i + 1] if i + 1 < self.n_blocks else 0.0
        exposed = max(nbytes / transfer.d2h_bytes_per_s - hidden_down, 0.0)
        exposed += max(nbytes / transfer.h2d_bytes_per_s - bwd[i], 0.0)
        return exposed + 1e-6  # a copy is never free: prefer keeping when memory allows
