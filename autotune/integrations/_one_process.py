"""The per-rank part of a data-parallel result, for a trainer that runs its own data
parallelism: it wraps the model for DDP itself, so the rest of the config applies per
process; FSDP2's sharding it would have to do as tuned, which it cannot be told."""

from __future__ import annotations

from autotune.config import TrainConfig
from autotune.errors import ConfigError, warn
from autotune.result import TuneResult

__all__ = ["per_process"]


def per_process(result: TuneResult, trainer: str) -> TrainConfig:
    """``result.config`` without its data parallelism (the trainer's DDP does that); of a
    table per sequence length, the longest row's, with a warning.

    Raises:
        ConfigError: the result shards with FSDP2, which ``trainer`` would not do as tuned.
    """
    c = result.config
    if c.parallel == "fsdp":
        raise ConfigError(
            f"this result shards with FSDP2 over {c.world_size} ranks, which {trainer} "
            "cannot be told to do as tuned; train it with autotune.prepare(model, result) "
            "under torchrun, or export it (autotune export --to accelerate) and check the "
            "peak."
        )
    if result.by_length:
        warn(
            f"{trainer} trains every batch with one config: the longest row's of this table "
            "per sequence length (it holds every batch, at the speed of the longest); to "
            "train each length with its row, use autotune.prepare or autotune.apply.",
        )
    return c.replace(parallel="none", world_size=1)
