"""``Runner``: one optimizer step at a time, exactly as a :class:`TrainConfig` says.

Micro-batches with exact mean-loss weighting, autocast, a GradScaler for fp16,
checkpointed and offloaded blocks, an offloaded optimizer, and the fallback ladder on an
out-of-memory error. Tuning profiles and verifies with this very runner, so what was
measured is what runs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autotune._backend import backend_for
from autotune._device import resolve_device
from autotune.config import TrainConfig
from autotune.errors import AutotuneWarning, ConfigError
from autotune.train import _batch as batching
from autotune.train._checkpoint import (
    apply_checkpointing,
    apply_offloading,
    check_blocks,
    remove_checkpointing,
)
from autotune.train._loss import LossFn, call_model, compute_loss
from autotune.train._offload_activations import ActivationOffloader
from autotune.train._offload_optimizer import OptimizerOffloader
from autotune.train._optimizers import build_optimizer

__all__ = ["Runner"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Runner:
    """Trains a prepared model: one :meth:`step` is one optimizer step.

    Given fallbacks, a step that runs out of device memory is undone and run again, same
    batch, with the next fallback: the effective batch and the optimizer state are kept.

    Attributes:
        model: The model, on ``device``, with the config's checkpointing applied.
        optimizer: The optimizer the config names.
        config: The configuration in use.
        fallbacks: Configurations still to fall back to, fastest first.
        device: Where the model trains.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        *,
        lr: float,
        loss_fn: LossFn | None,
        device: torch.device,
        fallbacks: Sequence[TrainConfig] = (),
    ) -> None:
        for c in (config, *fallbacks):  # now, not at the first OOM in the middle of training
            check_blocks(model, c)
        self.model = model
        self.config = config
        self.device = device = resolve_device(device)
        self.ops = backend_for(device)
        self.loss_fn = loss_fn
        self.lr = lr
        self.fallbacks = [f for f in fallbacks if f.optimizer == config.optimizer]
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameters that require grad: nothing to train.")
        self.host: OptimizerOffloader | None = None
        """The host side of an offloaded optimizer (``None`` without optimizer offload)."""
        self.optimizer = self._build_optimizer(config.offload_optimizer)
        self.scaler = _scaler(config, device)
        self.offloader = ActivationOffloader(model, device)
        apply_offloading(model, config.offload_activations, self.offloader)
        self._in_optimizer_step = False
        self._closed = False
        self._budget = contextlib.ExitStack()

    def _build_optimizer(self, offload: bool) -> torch.optim.Optimizer:
        """The config's optimizer, on the device or (``offload``) over host master weights."""
        name, lr = self.config.optimizer, self.lr
        if self.host is not None:
            self.host.close()
            self.host = None
        if not offload:
            return build_optimizer(name, self.params, lr)
        self.host = OptimizerOffloader(
            self.params, self.device, lambda masters: build_optimizer(name, masters, lr)
        )
        return self.host.optimizer

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step over ``batch``, in micro-batches of ``micro_batch_size``.

        The batch normally holds ``effective_batch_size`` samples; any size works, and the
        gradient is that of the mean loss over the whole batch either way. On
        ``torch.OutOfMemoryError`` in the forward or backward, with fallbacks left, the
        partial step is freed, the next fallback takes over (with a warning), and the
        same batch runs again from the same random state and buffers.

        Returns:
            The mean loss over the batch (a detached scalar tensor, not synchronised).
        """
        if self._closed:
            raise ConfigError("this runner is closed; prepare a new one to train again.")
        while True:
            restore = self._snapshot() if self.fallbacks else None
            try:
                return self._step(batch)
            except torch.OutOfMemoryError as exc:
                if restore is None or self._in_optimizer_step:
                    # No fallback left, or weights already half-updated: not retried. The
                    # partial gradients go, so that a caller who retries starts clean.
                    self.zero_grad()
                    raise
                reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
            # Outside the except block, so that the traceback no longer pins the step's tensors.
            self.zero_grad()
            restore()
            previous = self.config
            self.switch(self.fallbacks.pop(0))
            warnings.warn(
                f"out of memory with {previous.describe()} ({reason}); the same batch runs "
                f"again with fallback {self.config.describe()}.",
                AutotuneWarning,
                stacklevel=2,
            )

    def _step(self, batch: Any) -> torch.Tensor:
        self._in_optimizer_step = False  # read by step() when an OOM comes out of here
        n = batching.batch_size(batch)
        total = torch.zeros((), device=self.device)
        chunks = batching.split(batch, self.config.micro_batch_size)
        for i, chunk in enumerate(chunks):
            weight = batching.batch_size(chunk) / n
            # Offloaded optimizer: the last micro-batch sends each gradient down as it is made.
            self.last_micro_batch(i == len(chunks) - 1)
            try:
                total += self.forward_backward(chunk, weight)
            finally:
                self.last_micro_batch(False)
        self._in_optimizer_step = True
        self.optimizer_step()
        return total

    def switch(self, config: TrainConfig) -> None:
        """Train with ``config`` from the next step on, keeping weights and optimizer state.

        Raises:
            ConfigError: ``config`` names another optimizer (its state could not be kept).
        """
        if config.optimizer != self.config.optimizer:
            raise ConfigError(
                f"cannot switch from optimizer {self.config.optimizer} to {config.optimizer} "
                "mid-training; prepare a new runner instead."
            )
        remove_checkpointing(self.model)
        apply_checkpointing(self.model, config.checkpoint)
        apply_offloading(self.model, config.offload_activations, self.offloader)
        if config.offload_optimizer != self.config.offload_optimizer:
            # The state moves with a state dict: load_state_dict puts it where the new
            # optimizer's parameters are (host or device).
            state = self.optimizer.state_dict()
            self.zero_grad()
            self.optimizer = self._build_optimizer(config.offload_optimizer)
            self.optimizer.load_state_dict(state)
        self.scaler = _scaler(config, self.device, self.scaler)
        self.config = config

    def last_micro_batch(self, last: bool) -> None:
        """Mark the coming backward as the step's last (offloaded optimizer: grads go down)."""
        if self.host is not None:
            self.host.collect = last

    def zero_grad(self) -> None:
        """Free every gradient (on the host too, with an offloaded optimizer)."""
        if self.host is not None:
            self.host.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def hold_budget(
        self, budget_bytes: int, *, context_bytes: int = 0, foreign_bytes: int = 0
    ) -> None:
        """Cap the device's caching allocator so that it and the context stay within
        ``budget_bytes`` until :meth:`close`, as verification did; ``foreign_bytes``, what
        the allocator holds for other tensors, comes on top. A device without a caching
        allocator is not capped."""
        ops = self.ops
        if not ops.caching:
            return
        self._budget.close()
        self._budget.enter_context(ops.cap(budget_bytes - context_bytes + foreign_bytes))

    def close(self) -> None:
        """Release what the runner holds on the model: gradients on both sides, the
        offloaded optimizer's gradient hooks (they keep its pinned host memory alive), and
        the checkpoint and offload wrappers of the blocks. The weights stay as trained.
        Closing twice is harmless; the runner cannot step after it.
        """
        self.zero_grad()
        if self.host is not None:
            self.host.close()
        remove_checkpointing(self.model)
        self._budget.close()  # the allocator's cap as it was before
        self._closed = True

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _snapshot(self) -> Any:
        """A function that puts the random state and buffers back as they are now."""
        cpu_rng = torch.random.get_rng_state()
        device_rng = self.ops.rng_state()
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]

        def restore() -> None:
            torch.random.set_rng_state(cpu_rng)
            if device_rng is not None:
                self.ops.set_rng_state(device_rng)
            with torch.no_grad():
                for live, saved in buffers:
                    live.copy_(saved)
            self.ops.empty_cache()

        return restore

    def forward_backward(self, chunk: Any, weight: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss scaled by ``weight``."""
        loss = self.forward_loss(chunk, weight)
        self.backward(loss)
        return loss.detach().float()

    def forward_loss(self, chunk: Any, weight: float = 1.0) -> torch.Tensor:
        """Forward of one micro-batch: its loss times ``weight``, ready for :meth:`backward`."""
        chunk = batching.to_device(chunk, self.device, non_blocking=True)
        with self.autocast():
            output = call_model(self.model, chunk, has_loss_fn=self.loss_fn is not None)
            # The output goes out of scope here, so what only it held is freed before backward.
            return compute_loss(output, chunk, self.loss_fn) * weight

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss from :meth:`forward_loss` (scaled for fp16)."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients and free them."""
        if self.host is not None:
            self.host.step(self.apply_step)
        else:
            self.apply_step(self.optimizer)
        self.zero_grad()

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` (through the GradScaler for fp16); gradients are kept."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context of the config's precision (a no-op for fp32)."""
        dtype = _DTYPES.get(self.config.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)


def _scaler(
    config: TrainConfig, device: torch.device, previous: torch.amp.GradScaler | None = None
) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (``None`` otherwise), carrying ``previous``'s scale and counters.

    Its scale lives where the optimizer steps. An offloaded optimizer unscales host
    gradients; a scale left on the GPU would reach the host by a non-blocking copy that
    torch does not wait for. On the host, scaling the loss copies it up (from pageable
    memory, so the copy has read it before it returns) and unscaling needs no copy.
    """
    if config.precision != "fp16":
        return None
    home = torch.device("cpu") if config.offload_optimizer else device
    scaler = torch.amp.GradScaler(home.type)
    if previous is not None:
        scaler.load_state_dict(previous.state_dict())
    scaler.scale(torch.ones((), device=home))  # the scale is made on ``home`` now
    return scaler
