"""``TrainConfig``: one training configuration, every knob autotune searches.

The names of the precisions and optimizers live here, at the bottom of the package, so
that every layer can validate a knob without importing the code that implements it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.errors import ConfigError

__all__ = ["MAX_BATCH", "OPTIMIZERS", "PRECISIONS", "TrainConfig"]

MAX_BATCH = 2**31 - 1
"""The largest micro-batch size or accumulation count a config may hold."""
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""Training precisions: fp32, bf16 autocast, fp16 autocast with a GradScaler."""
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd", "adafactor", "adamw8bit")
"""Optimizer names; :mod:`autotune.train._optimizers` builds them."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training configuration: every knob autotune searches, each with a safe default."""

    micro_batch_size: int = 1
    """Samples per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated before each optimizer step."""
    precision: str = "fp32"
    """``fp32``; ``bf16`` (autocast); or ``fp16`` (autocast with a GradScaler)."""
    checkpoint: tuple[str, ...] = ()
    """Blocks (qualified module names) whose activations are recomputed in backward."""
    offload_activations: tuple[str, ...] = ()
    """Blocks whose saved activations go to pinned host memory."""
    optimizer: str = "adamw"
    """Optimizer name, one of :data:`OPTIMIZERS`."""
    offload_optimizer: bool = False
    """Keep optimizer states and run the step on the host."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "grad_accum_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH:
                shown = value if type(value) is not int else f"{value:.3g}"
                raise ConfigError(
                    f"{name} must be an integer from 1 to {MAX_BATCH}, got {str(shown)[:40]}."
                )
        if self.precision not in PRECISIONS:
            got = str(self.precision)[:40]
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {got!r}.")
        if self.optimizer not in OPTIMIZERS:
            got = str(self.optimizer)[:40]
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {got!r}.")
        for name in ("checkpoint", "offload_activations"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(
                    f"{name} must be a list of block names, got {type(value).__name__}."
                )
            object.__setattr__(self, name, tuple(value))
        both = set(self.checkpoint) & set(self.offload_activations)
        if both:
            raise ConfigError(
                f"blocks {sorted(both)} are both checkpointed and offloaded; "
                "a block is kept, checkpointed or offloaded, not two of these."
            )
        if not isinstance(self.offload_optimizer, bool):
            raise ConfigError(
                f"offload_optimizer must be true or false, got {self.offload_optimizer!r}."
            )

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step: ``micro_batch_size * grad_accum_steps``."""
        return self.micro_batch_size * self.grad_accum_steps

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some knobs changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A one-line human summary of the knobs."""
        parts = [
            f"micro_batch={self.micro_batch_size}",
            f"accum={self.grad_accum_steps}",
            self.precision,
            f"checkpoint={len(self.checkpoint)}",
            self.optimizer,
        ]
        if self.offload_activations:
            parts.append(f"offload_act={len(self.offload_activations)}")
        if self.offload_optimizer:
            parts.append("offload_opt")
        return " ".join(parts)
