"""Optimizers of a user's own, importable by path (``user_optimizers:name``) in the tests:
what nearly every LLM recipe builds, and one autotune has never heard of."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def decoupled_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's ``configure_optimizers``: weight decay on the matrices only (not on norms
    and biases), betas (0.9, 0.95), fused where torch has the kernel (CUDA, the CPU)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = all(p.device.type in ("cpu", "cuda") for p in trainable)
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=fused)


class SignMomentum(torch.optim.Optimizer):
    """A hand-written optimizer (Lion's shape): one momentum buffer per parameter, a step
    of the momentum's sign."""

    def __init__(self, params: list[torch.Tensor], lr: float = 1e-3, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:  # Lightning's: the forward and backward run in here
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                momentum = state["momentum"]
                momentum.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(momentum.sign(), alpha=-group["lr"])
        return loss


def sign_momentum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """:class:`SignMomentum` over the trainable parameters."""
    return SignMomentum(params, lr=1e-3)
