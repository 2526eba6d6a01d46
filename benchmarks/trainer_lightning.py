"""Inside Lightning: the ``Autotune`` callback against ``BatchSizeFinder(mode="binsearch")``.

The module is what a Lightning user writes around a case's model: ``training_step``
returns the loss by autotune's calling convention, ``configure_optimizers`` returns
AdamW, and the dataloader's batch size is ``self.batch_size``.

* **autotune**: ``Autotune(budget_gb, global_batch_size=G)`` tunes at fit start (its own
  guards keep the budget) and trains as tuned; later rounds apply the same result with
  ``Autotune.from_result`` on a fresh module.
* **BatchSizeFinder**: Lightning's finder (``mode="binsearch"``, ``max_val=G``, its
  defaults otherwise: start at 2, 3 steps per trial, 5% margin) runs fp32 under the CPU
  budget guard, armed for each batch (its error reads as torch's CPU allocator's, which Lightning's
  ``is_oom_error`` recognises). The user then keeps the global batch exact: batch size =
  the largest divisor of ``G`` not above the one found, ``accumulate_grad_batches`` = the
  rest.

Each timed fit trains a fresh module for ``WARMUP + TIMED`` optimizer steps, without a
guard (its bookkeeping would slow both arms).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from torch.utils.data import DataLoader

from autotune import TuneResult
from autotune.integrations.lightning import Autotune
from autotune.train._loss import call_model, compute_loss

from .baseline import kept_global
from .budgets import Budget
from .cases import Case
from .trainer_parts import TIMED, WARMUP, Clock, Guard, Rows

__all__ = ["Baseline", "autotune_arm", "finder_arm", "timed_autotune", "timed_baseline"]

_FIRST_BATCH = 8  # the dataloader's batch size before tuning: the tuner's sample


class CaseModule(pl.LightningModule):
    """A case's model as a LightningModule; with a guard, each batch runs under the
    budget (module hooks: the finder runs its trials without the trainer's callbacks)."""

    def __init__(self, case: Case, data: Any, batch_size: int, guard: Guard | None = None) -> None:
        super().__init__()
        self.model = case.build()
        self.loss_fn = case.loss_fn
        self.data = data
        self.batch_size = batch_size
        self.guard = guard

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.guard is not None:
            self.guard.arm()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.guard is not None:
            self.guard.disarm()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        output = call_model(self.model, batch, has_loss_fn=self.loss_fn is not None)
        return compute_loss(output, batch, self.loss_fn)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-6)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Rows(self.data), batch_size=self.batch_size)


class _Ticks(pl.Callback):
    def __init__(self) -> None:
        self.clock = Clock()
        self.steps = 0

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        if trainer.global_step > self.steps:  # an optimizer step ended
            self.steps = trainer.global_step
            self.clock.tick()


class _Guarded(pl.Callback):
    """Counts live bytes from setup (before the finder's trials) to the start of training."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def setup(self, trainer: Any, module: pl.LightningModule, stage: str) -> None:
        self.guard.start(module)

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.guard.stop()


def _trainer(max_steps: int, *callbacks: pl.Callback, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def autotune_arm(case: Case, data: Any, budget: Budget) -> TuneResult:
    """Tune with the callback at fit start (one step trained after)."""
    g = case.global_batch_size
    callback = Autotune(budget.gib, global_batch_size=g, space=case.space, seed=0)
    _trainer(1, callback).fit(CaseModule(case, data, _FIRST_BATCH))
    assert callback.result is not None
    return callback.result


class Baseline:
    """What the finder found and what the user trains with."""

    def __init__(self, found: int, global_batch: int, seconds: float) -> None:
        self.found = found
        self.batch_size = kept_global(found, global_batch)
        self.accumulate = global_batch // self.batch_size
        self.seconds = seconds


def finder_arm(case: Case, data: Any, budget: Budget) -> Baseline:
    """Run ``BatchSizeFinder`` under the budget guard."""
    g = case.global_batch_size or 32
    finder = BatchSizeFinder(mode="binsearch", max_val=g)
    guard = Guard(budget.budget_bytes)
    module = CaseModule(case, data, 2, guard)
    started = time.perf_counter()
    try:
        _trainer(1, finder, _Guarded(guard)).fit(module)
    finally:
        guard.stop()
    return Baseline(module.batch_size, g, time.perf_counter() - started)


def timed_autotune(case: Case, data: Any, result: TuneResult) -> float:
    """Samples/s of a fit with the tuned result applied."""
    ticks = _Ticks()
    module = CaseModule(case, data, _FIRST_BATCH)
    _trainer(WARMUP + TIMED, Autotune.from_result(result), ticks).fit(module)
    return ticks.clock.samples_per_s(result.config.effective_batch_size)


def timed_baseline(case: Case, data: Any, baseline: Baseline) -> float:
    """Samples/s of an fp32 fit at the finder's batch size, the global batch kept."""
    ticks = _Ticks()
    module = CaseModule(case, data, baseline.batch_size)
    trainer = _trainer(WARMUP + TIMED, ticks, accumulate_grad_batches=baseline.accumulate)
    trainer.fit(module)
    return ticks.clock.samples_per_s(baseline.batch_size * baseline.accumulate)
