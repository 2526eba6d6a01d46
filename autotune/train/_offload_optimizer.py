"""Optimizer offload: fp32 master weights, gradients and optimizer state live on the host.

In the last micro-batch of a step each gradient is copied down as soon as autograd has
accumulated it (overlapping the rest of the backward) and freed on the device; the step
runs on the host; the updated weights go back up on a copy stream that the compute
stream waits for before it touches them.

On CPU the host is the device: the copies are plain copies and the math is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autotune.device import backend_for, host_empty, host_memory, mark_host

__all__ = ["OptimizerOffloader"]


class OptimizerOffloader:
    """Host-side optimizer: master weights, gradients and state in (pinned) host memory.

    Args:
        params: The trainable parameters, on the device.
        device: The training device.
        build: Builds the optimizer over the host master weights.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        device: torch.device,
        build: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        self.device = device
        self.backend = backend_for(device)
        self.streams = self.backend.streams  # copies on side streams, overlapping compute
        self.params = list(params)
        self.masters = []
        for p in self.params:
            master = host_empty(p, pinned=self.backend.pins)
            master.copy_(p.detach())
            master.requires_grad_(p.requires_grad)
            self.masters.append(master)
        self._d2h = self.backend.new_stream() if self.streams else None
        self._h2d = self.backend.new_stream() if self.streams else None
        with host_memory():
            self.optimizer = build(self.masters)
        self.collect = False
        """True during the last micro-batch's backward: gradients go to the host as made."""
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self.collect and p.grad is not None:
            self._to_host(self._index[id(p)])

    def _to_host(self, i: int) -> None:
        p, master = self.params[i], self.masters[i]
        assert p.grad is not None
        if master.grad is None:
            master.grad = host_empty(p.grad, pinned=self.backend.pins)
        if self.streams:
            assert self._d2h is not None
            self._d2h.wait_stream(self.backend.current_stream())
            with self.backend.use_stream(self._d2h):
                master.grad.copy_(p.grad, non_blocking=True)
            self.backend.record_stream(p.grad, self._d2h)
        else:
            master.grad.copy_(p.grad)
        p.grad = None  # freed on the device once the copy is done

    def gather(self) -> None:
        """Bring every gradient still on the device to the host, and wait for all copies."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._to_host(i)
        if self.streams:
            assert self._d2h is not None
            self._d2h.synchronize()

    def step(self, run: Callable[[torch.optim.Optimizer], None]) -> None:
        """Gather gradients, run ``run(optimizer)`` on the host, send the weights back up."""
        self.gather()
        self.host_step(run)
        self.upload()

    def host_step(self, run: Callable[[torch.optim.Optimizer], None]) -> None:
        """Run ``run(optimizer)`` over the host master weights (gradients gathered)."""
        with host_memory():
            run(self.optimizer)
            mark_host(t for s in self.optimizer.state.values() for t in _tensors(s))

    def upload(self) -> None:
        """Copy the master weights into the device parameters (asynchronously on CUDA)."""
        if not self.streams:
            with torch.no_grad():
                for p, master in zip(self.params, self.masters, strict=True):
                    p.copy_(master)
            return
        assert self._h2d is not None
        self._h2d.wait_stream(self.backend.current_stream())
        with self.backend.use_stream(self._h2d):
            for p, master in zip(self.params, self.masters, strict=True):
                p.data.copy_(master, non_blocking=True)
        # Whatever runs next on the compute stream (the next forward, a state_dict copy)
        # sees the new weights; the CPU is not blocked.
        self.backend.current_stream().wait_stream(self._h2d)

    def zero_grad(self) -> None:
        """Drop the gradients, on the host and on the device."""
        for p, master in zip(self.params, self.masters, strict=True):
            p.grad = None
            master.grad = None

    def pinned_tensors(self) -> list[torch.Tensor]:
        """The pinned host buffers: master weights and the gradients they hold now."""
        return [*self.masters, *(m.grad for m in self.masters if m.grad is not None)]

    def host_bytes(self) -> int:
        """Host bytes held: master weights and gradient buffers (as the pinned allocator
        takes them), and optimizer state."""
        pinned = self.pinned_tensors()
        state = [t for s in self.optimizer.state.values() for t in _tensors(s)]
        return sum(self.backend.host_bytes(t.untyped_storage().nbytes()) for t in pinned) + sum(
            t.untyped_storage().nbytes() for t in state
        )

    def close(self) -> None:
        """Remove the gradient hooks (the runner switched away from offload)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]
