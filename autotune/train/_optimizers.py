"""The optimizers autotune can build, by name.

The tuner never swaps the user's optimizer unless the search space is widened to other
names: optimizers change the training math, not only its speed and memory.

``adamw8bit`` is bitsandbytes' ``AdamW8bit`` (optional extra ``autotune[8bit]``): fused
CUDA kernels, a CPU backend, plain uint8 state tensors that the memory tracker counts
exactly, and no compilation on first use (torchao's ``AdamW8bit`` compiles its step with
``torch.compile``, about 20 s on first use, which tuning cannot afford).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from autotune.config import BITSANDBYTES_OPTIMIZERS, OPTIMIZERS
from autotune.errors import ConfigError

__all__ = ["OptimizerSpec", "available", "build_optimizer", "fused_runs"]


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer, and what its state costs."""

    build: Callable[[Iterable[torch.Tensor], float], torch.optim.Optimizer]
    state_bytes_per_param: float
    """Approximate state bytes per fp32 parameter, for messages; the profile measures it."""
    summary: str


def _adamw(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def _adamw_fused(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # What nanoGPT, torchtitan and Hugging Face's optim="adamw_torch_fused" build: one
    # kernel updates every parameter, where the foreach AdamW makes temporary copies of
    # the states for each of its passes.
    return torch.optim.AdamW(params, lr=lr, fused=True)


def fused_runs(device: torch.device) -> bool:
    """Whether torch has the fused AdamW kernel for ``device`` (CUDA, and the CPU since
    torch 2.4): AdamW refuses ``fused=True`` on a device without it."""
    try:
        probe = torch.zeros(1, device=device, requires_grad=True)
        torch.optim.AdamW([probe], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def _sgd(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _adafactor(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=lr)


def _adamw8bit(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # AdamW's defaults (betas, eps, weight decay 0.01), states quantised blockwise to 8 bits.
    optimizer: torch.optim.Optimizer = _bitsandbytes().optim.AdamW8bit(params, lr=lr)
    return optimizer


def _paged_adamw8bit(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # What Hugging Face's optim="paged_adamw_8bit" builds: AdamW8bit whose states of
    # parameters of 1e5 elements or more live in CUDA unified memory (paged to the host
    # when the device is full). Off CUDA, its unpaged twin: the same state and math.
    return _paged(params, lr, "PagedAdamW8bit", "AdamW8bit")


def _paged_adamw(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # Hugging Face's optim="paged_adamw_32bit": fp32 states, paged as above.
    return _paged(params, lr, "PagedAdamW32bit", "AdamW32bit")


def _paged(
    params: Iterable[torch.Tensor], lr: float, paged: str, unpaged: str
) -> torch.optim.Optimizer:
    params = list(params)
    # bitsandbytes pages through CUDA unified memory only (elsewhere it warns and runs
    # unpaged): build the unpaged twin where the parameters are not on CUDA.
    cuda = any(p.device.type == "cuda" for p in params)
    build = getattr(_bitsandbytes().optim, paged if cuda else unpaged)
    optimizer: torch.optim.Optimizer = build(params, lr=lr)
    return optimizer


def _bitsandbytes() -> Any:
    """Import bitsandbytes, or say how to install it."""
    # Its CPU backend logs a warning at import about optional 4-bit kernels we never use.
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(
            "optimizers adamw8bit, paged_adamw8bit and paged_adamw need bitsandbytes: "
            "pip install 'autotune[8bit]' "
            "(or pip install bitsandbytes)."
        ) from None
    finally:
        log.setLevel(level)
    return bitsandbytes


def available(name: str) -> bool:
    """Whether optimizer ``name`` can be built here (its optional library is installed)."""
    if name not in BITSANDBYTES_OPTIMIZERS:
        return name in _SPECS
    try:
        _bitsandbytes()
    except ConfigError:
        return False
    return True


_SPECS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw, 8.0, "AdamW, two fp32 states per parameter"),
    "adamw_fused": OptimizerSpec(
        _adamw_fused, 8.0, "AdamW as one fused kernel (torch), two fp32 states per parameter"
    ),
    "sgd": OptimizerSpec(_sgd, 4.0, "SGD with momentum 0.9, one fp32 state per parameter"),
    "adafactor": OptimizerSpec(_adafactor, 0.5, "Adafactor, factored second moments"),
    "adamw8bit": OptimizerSpec(
        _adamw8bit, 2.0, "AdamW with 8-bit blockwise-quantised states (bitsandbytes)"
    ),
    "paged_adamw8bit": OptimizerSpec(
        _paged_adamw8bit, 2.0, "adamw8bit with its states paged in CUDA unified memory"
    ),
    "paged_adamw": OptimizerSpec(
        _paged_adamw, 8.0, "AdamW (bitsandbytes, fp32 states) paged in CUDA unified memory"
    ),
}


def build_optimizer(name: str, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """Build the optimizer called ``name`` over ``params``.

    Raises:
        ConfigError: the name is unknown.
    """
    spec = _SPECS.get(name)
    if spec is None:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}.")
    return spec.build(params, lr)
