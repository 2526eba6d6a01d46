"""``Runner``: one optimizer step at a time, exactly as a :class:`TrainConfig` says.

A :class:`~autotune.train._applied.Applied` handle with a loss and the loop over
micro-batches: exact mean-loss weighting, autocast, a GradScaler for fp16, checkpointed and
offloaded blocks, an offloaded optimizer, gradient clipping, a learning-rate scheduler and
the fallback ladder on an out-of-memory error. Tuning profiles and verifies with this very
runner, so what was measured is what runs.

``Workload``: what one training step runs, as the profiler and the verifier take it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.config import TrainConfig
from autotune.result import LengthRow
from autotune.train import _batch as batching
from autotune.train._applied import Applied
from autotune.train._chunked_loss import chunked_loss
from autotune.train._loss import LossFn, LossMean, call_model, compute_loss
from autotune.train._refusals import LOSS
from autotune.train._steps import Scheduler, apply_step

__all__ = ["Runner", "Workload"]


class Runner(Applied):
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
        lr: float | None,
        loss_fn: LossFn | None,
        device: torch.device,
        fallbacks: Sequence[TrainConfig] = (),
        units: Sequence[str] = (),
        table: Sequence[LengthRow] = (),
        written: Sequence[str] | None = None,
        loss_mean: LossMean | None = None,
    ) -> None:
        self.loss_fn = loss_fn  # before the config is applied: a compiled model takes it
        super().__init__(
            model,
            config,
            lr=lr,
            device=device,
            fallbacks=fallbacks,
            units=units,
            table=table,
            written=written,
            loss_mean=loss_mean,
        )
        _ = self.optimizer  # built now: its memory is part of what the runner holds

    def step(
        self,
        batch: Any,
        *,
        max_grad_norm: float | None = None,
        scheduler: Scheduler | None = None,
    ) -> torch.Tensor:
        """One optimizer step over ``batch``, in micro-batches of ``micro_batch_size``.

        The batch normally holds ``effective_batch_size`` samples; any size works, and the
        gradient is that of the mean loss over the whole batch either way. With a table
        tuned per sequence length, the batch trains with the row of its padded length
        (:meth:`select`); a batch longer than the longest row is a ``BatchError``. On
        ``torch.OutOfMemoryError`` in the forward or backward, with fallbacks left, the
        partial step is freed, the next fallback takes over (with a warning), and the
        same batch runs again from the same random state and buffers.

        Args:
            batch: The samples of one optimizer step.
            max_grad_norm: Clip the gradients to this total 2-norm before the update.
            scheduler: A learning-rate scheduler of :attr:`optimizer`, stepped after it.

        Returns:
            The mean loss over the batch (a detached scalar tensor, not synchronised);
            with data parallelism, this process's part of the global batch's: their mean
            over the processes is the global batch's mean loss.

        Raises:
            NonFiniteError: a step was refused, its loss or gradients not finite: the
                weights keep their last finite values. The device decides, without the
                host waiting for it, where it can (a fused optimizer, fp16's scaler): then
                the refusal is said on the CPU by this step, on a GPU by one of the next
                two (the steps between are applied), or by :meth:`check_steps`.
        """
        self.select(batch)
        return self.run(self._step, batch, max_grad_norm, scheduler)

    def _step(
        self, batch: Any, max_grad_norm: float | None, scheduler: Scheduler | None
    ) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for chunk, weight in self._chunks(batch):
            total += self.forward_backward(chunk, weight)
        if self.scaler is not None:  # the scaler skips a step whose loss is not finite
            self.refusals.flag(~torch.isfinite(total), LOSS)
        self.optimizer_step(max_grad_norm=max_grad_norm, scheduler=scheduler)
        return total

    def forward_backward(self, chunk: Any, weight: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss scaled by ``weight``."""
        loss = self.forward_loss(chunk, weight)
        self.backward(loss)
        return loss.detach().float()

    compiles_loss = True

    def _loss_fn(self) -> LossFn | None:
        return self.loss_fn

    def forward_loss(
        self, chunk: Any, weight: float | torch.Tensor = 1.0, *, evaluating: bool = False
    ) -> torch.Tensor:
        """Forward of one micro-batch: its loss times ``weight``, ready for :meth:`backward`.
        ``evaluating``: the model's own forward and loss, as a trainer's evaluation runs
        them (the chunked loss trains only: an evaluation makes the logits)."""
        chunk = batching.to_device(chunk, self.device, non_blocking=True)
        chunked = self.config.chunked_loss and not evaluating
        if self.compiled_loss is not None and chunked == self.config.chunked_loss:
            return self.compiled_loss(self.parallel.module, chunk) * weight  # one graph
        with self.autocast():
            if chunked:  # the logits a slice of the tokens at a time
                return chunked_loss(self.parallel.module, chunk) * weight
            output = call_model(self.parallel.module, chunk, has_loss_fn=self.loss_fn is not None)
            # The output goes out of scope here, so what only it held is freed before backward.
            return compute_loss(output, chunk, self.loss_fn) * weight

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` (through the GradScaler for fp16); gradients are kept."""
        apply_step(optimizer, self.scaler)

    def __enter__(self) -> Runner:
        return self


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
