"""``Workload``: what one training step runs, as the profiler and the verifier take it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.train._loss import LossFn

__all__ = ["Workload"]


@dataclass(frozen=True, eq=False)
class Workload:
    """A model (the tuner's copy), the user's sample batch and loss, the blocks, and the
    device, with what other tensors of the process held on it when tuning began."""

    model: nn.Module
    sample: Any
    """The user's sample batch (resized to each configuration's micro-batch)."""
    loss_fn: LossFn | None
    blocks: tuple[str, ...]
    """The blocks that may be checkpointed or offloaded (FSDP's units)."""
    device: torch.device
    foreign_bytes: int = 0
    """CUDA bytes held by other tensors of the process when tuning began."""

    def over(self, model: nn.Module, blocks: tuple[str, ...] = ()) -> Workload:
        """The same workload on ``model`` (a copy; with ``blocks``, a shallow one)."""
        return dataclasses.replace(self, model=model, blocks=blocks or self.blocks)
