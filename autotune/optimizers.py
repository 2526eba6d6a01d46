"""The optimizers autotune can build, by name.

The tuner never swaps the user's optimizer unless the search space is widened to other
names: optimizers change the training math, not only its speed and memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .errors import ConfigError

__all__ = ["OPTIMIZERS", "OptimizerSpec", "build_optimizer"]


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer, and what its state costs."""

    build: Callable[[Iterable[torch.Tensor], float], torch.optim.Optimizer]
    state_bytes_per_param: float
    """Approximate state bytes per fp32 parameter, for messages; the profile measures it."""
    summary: str


def _adamw(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def _sgd(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _adafactor(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=lr)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw, 8.0, "AdamW, two fp32 states per parameter"),
    "sgd": OptimizerSpec(_sgd, 4.0, "SGD with momentum 0.9, one fp32 state per parameter"),
    "adafactor": OptimizerSpec(_adafactor, 0.5, "Adafactor, factored second moments"),
}


def build_optimizer(
    name: str, params: Iterable[torch.Tensor], lr: float
) -> torch.optim.Optimizer:
    """Build the optimizer called ``name`` over ``params``.

    Raises:
        ConfigError: the name is unknown.
    """
    spec = OPTIMIZERS.get(name)
    if spec is None:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}.")
    return spec.build(params, lr)
