"""The exhaustive grid, measured for real with the tuner's own :class:`~autotune.verify._verifier.Verifier`.

Grid: every micro-batch size dividing the global batch (a power-of-two ladder when none
is fixed) x each precision and optimizer the tuner searched x checkpointing none, all
blocks, all blocks selectively, and every partial mask the tuner itself verified at that
size. A configuration
over the budget (``torch.OutOfMemoryError`` from the budget guard on CPU, from the capped
allocator on CUDA) is excluded, exactly as the tuner's verification excludes it.

On CPU the peak is an exact, deterministic count of live bytes, so a configuration
measured under a larger budget is not run again under a smaller one: its peak decides.
On CUDA every budget is measured afresh (the capped allocator may behave differently).
A checkpointed configuration whose micro-batch fits without checkpointing is dominated
(same work plus recomputation) and is skipped unless pruning is turned off.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from autotune import Measurement, TrainConfig, TuneResult
from autotune.config import FUSED_OPTIMIZERS
from autotune.train._loss import LossFn
from autotune.verify._verifier import Verifier

__all__ = [
    "SKIPPED",
    "Point",
    "Sweep",
    "grid_configs",
    "hand_candidates",
    "hand_config",
    "median_throughput",
    "sizes_for",
]

SKIPPED = "skipped: dominated, the same micro-batch"

Mask = tuple[tuple[str, ...], tuple[str, ...]]
"""The blocks checkpointed, and those checkpointed selectively."""


@dataclass(frozen=True)
class Point:
    """One configuration measured at one budget."""

    config: TrainConfig
    measured: Measurement | None
    error: str | None = None


def hand_candidates(points: Sequence[Point], n_blocks: int) -> list[TrainConfig]:
    """What an expert sets by hand, taken from the measured grid: the user's optimizer on
    the device, for each precision no checkpointing or every block checkpointed, each at
    the largest micro-batch that fits. The hand config is the fastest of these, as one
    who tried them all: :func:`hand_config` over timings of them taken together (one
    timing each in a sweep is too noisy to choose by)."""
    default = TrainConfig().optimizer
    users = (default, FUSED_OPTIMIZERS.get(default, default))  # fused where the device has it
    picks: dict[tuple[str, bool], Point] = {}
    for p in points:
        c = p.config
        if p.measured is None or c.optimizer not in users or c.offload_optimizer:
            continue
        if c.offload_activations or c.selective_checkpoint:
            continue
        if len(c.checkpoint) not in (0, n_blocks):
            continue
        key = (c.precision, bool(c.checkpoint))
        if key not in picks or c.micro_batch_size > picks[key].config.micro_batch_size:
            picks[key] = p
    return [p.config for p in picks.values()]


def hand_config(medians: Mapping[TrainConfig, float | None]) -> TrainConfig | None:
    """The fastest of the hand candidates by their median throughput (``None``: none ran)."""
    ran = {c: m for c, m in medians.items() if m is not None}
    return max(ran, key=ran.__getitem__) if ran else None


def sizes_for(global_batch_size: int | None, *, ladder_max: int = 64) -> list[int]:
    """Divisors of the global batch, or powers of two up to ``ladder_max`` when not fixed."""
    if global_batch_size is None:
        return [2**i for i in range(ladder_max.bit_length()) if 2**i <= ladder_max]
    return [b for b in range(1, global_batch_size + 1) if global_batch_size % b == 0]


def grid_configs(
    result: TuneResult,
    blocks: Sequence[str],
    global_batch_size: int | None,
    precisions: Iterable[str],
    optimizers: Iterable[str],
) -> list[TrainConfig]:
    """The grid for one tuning result (see the module docstring), the tuned config included."""
    tuned_masks: dict[tuple[int, str, str], set[Mask]] = {}
    for config in [result.config, *(t.config for t in result.trials)]:
        key = (config.micro_batch_size, config.precision, config.optimizer)
        tuned_masks.setdefault(key, set()).add((config.checkpoint, config.selective_checkpoint))
    every: tuple[str, ...] = tuple(blocks)
    out: list[TrainConfig] = []
    for p in precisions:
        for o in optimizers:
            for b in sizes_for(global_batch_size):
                accum = global_batch_size // b if global_batch_size else 1
                masks = {((), ()), (every, ()), ((), every), *tuned_masks.get((b, p, o), set())}
                for ckpt, selective in sorted(masks, key=lambda m: (len(m[0]), len(m[1]))):
                    config = TrainConfig(
                        micro_batch_size=b,
                        grad_accum_steps=accum,
                        precision=p,
                        optimizer=o,
                        checkpoint=ckpt,
                        selective_checkpoint=selective,
                    )
                    if config not in out:
                        out.append(config)
    return out


class Sweep:
    """Measures configurations of one model on one device, at any budget.

    Args:
        model: A copy of the model on ``device`` (it is trained a little, as the tuner's).
        sample: The sample batch.
        device: The device.
        loss_fn: The case's loss function, or ``None``.
        context_bytes: CUDA context bytes (from :func:`autotune.device._target.discover`).
        foreign_bytes: CUDA bytes held by other tensors before the copy was made.
    """

    def __init__(
        self,
        model: nn.Module,
        sample: object,
        *,
        device: torch.device,
        loss_fn: LossFn | None,
        context_bytes: int = 0,
        foreign_bytes: int = 0,
    ) -> None:
        self.model = model
        self.sample = sample
        self.device = device
        self.loss_fn = loss_fn
        self.context_bytes = context_bytes
        self.foreign_bytes = foreign_bytes
        self._seen: dict[TrainConfig, tuple[int, Point]] = {}  # CPU: config -> (budget, point)

    def verifier(self, budget_bytes: int) -> Verifier:
        """The tuner's Verifier, with the tuner's defaults, at ``budget_bytes``."""
        return Verifier(
            self.model,
            self.sample,
            device=self.device,
            budget_bytes=budget_bytes,
            loss_fn=self.loss_fn,
            context_bytes=self.context_bytes,
            foreign_bytes=self.foreign_bytes,
        )

    def measure(self, config: TrainConfig, budget_bytes: int, *, reuse: bool = True) -> Point:
        """Measure ``config`` under the budget (reusing a CPU peak from a larger budget)."""
        if reuse and self.device.type == "cpu" and config in self._seen:
            seen_budget, point = self._seen[config]
            if point.measured is not None and point.measured.peak_bytes <= budget_bytes:
                return point
            if point.measured is not None:
                return Point(
                    config,
                    None,
                    f"out of memory: measured peak {point.measured.peak_bytes} bytes "
                    f"(at budget {seen_budget}) exceeds the budget of {budget_bytes}",
                )
            if seen_budget >= budget_bytes:
                return Point(config, None, point.error)
        measured, error = self.verifier(budget_bytes).trial(config)
        point = Point(config, measured, error)
        if reuse and self.device.type == "cpu":
            self._seen[config] = (budget_bytes, point)
        return point

    def grid(
        self, configs: Sequence[TrainConfig], budget_bytes: int, *, prune: bool = True
    ) -> list[Point]:
        """Measure every configuration of the grid under the budget.

        With ``prune``, a (fully or selectively) checkpointed configuration is skipped when
        the same micro-batch, precision and optimizer fit without checkpointing:
        checkpointing only adds recomputation, so it cannot be faster (the tuned config is
        measured regardless, in :meth:`remeasure`). Skipped points carry
        ``error="skipped: ..."``.
        """
        points: list[Point] = []
        fits: set[tuple[int, int, str, str]] = set()

        def wrapped(c: TrainConfig) -> int:
            return len(c.checkpoint) + len(c.selective_checkpoint)

        for c in sorted(configs, key=wrapped):
            key = (c.micro_batch_size, c.grad_accum_steps, c.precision, c.optimizer)
            if prune and wrapped(c) and key in fits:
                points.append(Point(c, None, f"{SKIPPED} fits without checkpointing"))
                continue
            point = self.measure(c, budget_bytes)
            if point.measured is not None and not wrapped(c):
                fits.add(key)
            points.append(point)
        order = {c: i for i, c in enumerate(configs)}
        return sorted(points, key=lambda p: order[p.config])

    def remeasure(
        self, configs: Sequence[TrainConfig], budget_bytes: int, *, rounds: int
    ) -> dict[TrainConfig, list[Point]]:
        """Measure ``configs`` again, round-robin, ``rounds`` times each (no reuse).

        Interleaving makes the configurations share the machine's slow and fast spells, so
        their ratios are fairer than those of one sweep on a shared machine.
        """
        out: dict[TrainConfig, list[Point]] = {c: [] for c in configs}
        for _ in range(rounds):
            for c in configs:
                out[c].append(self.measure(c, budget_bytes, reuse=False))
        return out


def median_throughput(points: Sequence[Point]) -> float | None:
    """Median samples/s over the runs that fitted; ``None`` if any run did not fit."""
    if not points or any(p.measured is None for p in points):
        return None
    return statistics.median(p.measured.samples_per_s for p in points if p.measured)
