"""What data parallelism a cost model plans for, and what it makes of each unit's bytes.

:class:`Layout` is the part of a :class:`~autotune.config.TrainConfig` the search does not
turn per setting; :class:`Units` the per-rank sizes of each FSDP2 unit (the blocks, then
the root) at one world size: shards padded to a multiple of the ranks on the first
dimension, as ``fully_shard`` pads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotune._profile_data import Profile
from autotune.config import TrainConfig

__all__ = ["Layout", "Units"]

_PARAM_DTYPE_BYTES = {"bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    """The data parallelism a cost model plans for: the knobs of :class:`TrainConfig`
    that the search does not turn per setting."""

    parallel: str = "none"
    world_size: int = 1
    keep_gathered: tuple[str, ...] = ()

    @staticmethod
    def of(config: TrainConfig) -> Layout:
        """The layout ``config`` trains under."""
        return Layout(config.parallel, config.world_size, config.keep_gathered)

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` trained this way."""
        if self.parallel == "none":
            return config
        return config.replace(
            parallel=self.parallel,
            world_size=self.world_size,
            keep_gathered=self.keep_gathered,
        )

    def describe(self) -> str:
        kept = f", {len(self.keep_gathered)} units kept gathered" if self.keep_gathered else ""
        return f"{self.parallel} x {self.world_size}{kept}"


@dataclass(frozen=True)
class Units:
    """Bytes of each FSDP unit (the blocks, then the root) at one world size."""

    shard: tuple[int, ...]
    """Sharded parameters per rank, padded."""
    gathered: tuple[int, ...]
    """All-gathered parameters (the flat buffer), in the parameter dtype."""
    grad_shard: tuple[int, ...]
    """Sharded gradients per rank (trainable parameters only)."""
    grad_full: tuple[int, ...]
    """The unit's full gradients, in the parameter dtype."""
    grad_single: tuple[int, ...]
    """The unit's gradients in the single-process profile."""
    reduce: tuple[int, ...]
    """The reduce-scatter input: full, padded gradients in the reduce dtype."""

    @staticmethod
    def of(profile: Profile, world: int, precision: str, *, cast: bool = False) -> Units:
        """``cast``: the single-process timeline had its parameters (and so its gradients)
        in the precision's dtype too."""
        k = len(profile.blocks)
        sizes = [[0] * (k + 1) for _ in range(6)]
        for unit, rows, row, item, trainable in profile.layout:
            u = unit if unit >= 0 else k
            padded = math.ceil(rows / world)
            scale = _PARAM_DTYPE_BYTES.get(precision, item) / item
            sizes[0][u] += padded * row
            sizes[1][u] += math.ceil(padded * world * row * scale)
            if trainable:
                sizes[2][u] += padded * row
                sizes[3][u] += math.ceil(rows * row * scale)
                sizes[4][u] += math.ceil(rows * row * scale) if cast else rows * row
                sizes[5][u] += padded * world * row
        return Units(*(tuple(s) for s in sizes))
