"""The fallback ladder inside Lightning's automatic optimization.

Lightning makes one optimizer step of ``accumulate_grad_batches`` batches, each a call of
its automatic optimization; the last one steps the optimizer. The :class:`Ladder` keeps
the step's batches where the dataloader made them (on the host: no device memory) until
the optimizer has stepped. When a forward or backward runs out of device memory before
the optimizer began its update, the partial gradients are freed, the random state and
the buffers are put back as they were when the step began, the next fallback takes over
(its checkpoint mask, activation offload and precision; its smaller micro-batch by
splitting each batch inside ``training_step`` with the handle's own micro-batches and
loss weights), and the step's
batches run again from the first. What the step's ``training_step`` logged before the
error is logged again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from autotune.config import TrainConfig
from autotune.errors import warn
from autotune.integrations._export import LIGHTNING_PRECISION
from autotune.integrations._lightning_tuning import step_loss
from autotune.train import Applied

__all__ = ["Ladder", "precision_plugin"]


def precision_plugin(config: TrainConfig, device: torch.device) -> Precision:
    """Lightning's precision plugin for the config's precision."""
    if config.precision == "fp32":
        return Precision()
    return MixedPrecision(LIGHTNING_PRECISION[config.precision], device.type)  # type: ignore[arg-type]


class Ladder:
    """Falls back down ``handle.fallbacks`` when a step of Lightning's loop runs out of
    device memory, and runs the step's batches again.

    Args:
        trainer: The trainer, fitting with automatic optimization on one device.
        handle: The tuned config applied to the trainer's module, with its fallbacks.
    """

    def __init__(self, trainer: pl.Trainer, handle: Applied) -> None:
        self.trainer = trainer
        self.handle = handle
        self.batch_size = handle.config.micro_batch_size  # what the dataloader yields
        self._step = vars(trainer.lightning_module).get("training_step")
        """The module's step as the ladder found it (a weighed one of the callback's)."""
        self.window: list[tuple[int, Any]] = []  # (batch_idx, batch on the host) this step
        self.updating = False  # the optimizer began its update: too late to fall back
        self._restore: Callable[[], None] | None = None
        self._host: Any = None
        self._optimization = trainer.fit_loop.epoch_loop.automatic_optimization
        self._run = self._optimization.run
        self._to_device = trainer.strategy.batch_to_device
        # On the instances: the classes and other trainers are untouched.
        self._optimization.run = self.run  # type: ignore[method-assign]
        trainer.strategy.batch_to_device = self.to_device  # type: ignore[method-assign]

    def remove(self) -> None:
        """Give the trainer and the module their own methods back."""
        vars(self._optimization).pop("run", None)
        vars(self.trainer.strategy).pop("batch_to_device", None)
        vars(self.trainer.lightning_module).pop("training_step", None)
        self.window.clear()
        self._restore = self._host = None

    def to_device(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """The strategy's ``batch_to_device``, keeping the host batch of a training step."""
        if self.trainer.training:
            self._host = batch
        return self._to_device(batch, *args, **kwargs)

    def run(
        self, optimizer: torch.optim.Optimizer, batch_idx: int, kwargs: OrderedDict[str, Any]
    ) -> Any:
        """Lightning's automatic optimization of one batch, run again on a fallback (with
        the step's earlier batches) after an out-of-memory error."""
        handle = self.handle
        if not handle.fallbacks:
            self.window.clear()
            return self._run(optimizer, batch_idx, kwargs)
        if not self.window:
            self._restore = handle.snapshot()
        self.window.append((batch_idx, self._host))
        again = False
        while True:
            self.updating = False
            try:
                if again:
                    self._replay(optimizer)
                out = self._run(optimizer, batch_idx, kwargs)
            except torch.OutOfMemoryError as exc:
                if self.updating or not handle.fallbacks:
                    handle.zero_grad()
                    self.window.clear()
                    raise
                reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
            else:
                if self.updating:  # the step is done: its batches are no longer needed
                    self.window.clear()
                return out
            # Outside the except block, so that the traceback no longer pins the step's tensors.
            handle.zero_grad()
            assert self._restore is not None
            self._restore()
            self._fall_back(reason)
            again = True

    def _replay(self, optimizer: torch.optim.Optimizer) -> None:
        """Forward and backward of the step's batches before the current one, again."""
        loop = self.trainer.fit_loop.epoch_loop
        for batch_idx, host in self.window[:-1]:
            batch = self._to_device(host, dataloader_idx=0)
            kwargs = loop._build_kwargs(OrderedDict(), batch, batch_idx)
            closure = self._optimization._make_closure(kwargs, optimizer, batch_idx)
            closure()
            closure.consume_result()

    def _fall_back(self, reason: str) -> None:
        handle, trainer = self.handle, self.trainer
        previous, config = handle.config, handle.fallbacks.pop(0)
        m = self.batch_size
        if config.micro_batch_size > m:  # the dataloader's batches are smaller: run them whole
            config = config.replace(
                micro_batch_size=m, grad_accum_steps=config.effective_batch_size // m
            )
        handle.switch(config)
        if config.precision != previous.precision:
            trainer.strategy.precision_plugin = precision_plugin(config, handle.device)
        module = trainer.lightning_module
        vars(module).pop("training_step", None)
        if self._step is not None:
            module.__dict__["training_step"] = self._step
        if config.micro_batch_size < m:
            module.__dict__["training_step"] = _split(module, handle)
        warn(
            f"out of memory with {previous.describe()} ({reason}); the step's "
            f"{len(self.window)} batches run again with fallback {config.describe()}.",
        )


def _split(module: pl.LightningModule, handle: Applied) -> Callable[..., Any]:
    """``module.training_step`` over the handle's micro-batches: the backward of each but
    the last runs here, with its loss weighted by its share of the batch (its samples, or
    its label tokens where the loss is a mean over them) and divided by the accumulation,
    as Lightning divides the loss it is returned."""
    step = module.training_step
    trainer = module.trainer

    def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        # The batch is on the device already; Lightning never offloads the optimizer, so
        # taking the pairs at once changes nothing the handle does between them.
        *rest, (last, last_weight) = handle.micro_batches(batch)
        for chunk, weight in rest:
            # In Lightning's order: weighted by its share, then divided by the accumulation.
            loss = step_loss(step(chunk, *args, **kwargs)) * weight
            loss = loss / trainer.accumulate_grad_batches
            with torch.autocast(trainer.strategy.root_device.type, enabled=False):
                trainer.strategy.backward(loss, trainer.optimizers[0])
            del loss
        out = step(last, *args, **kwargs)
        if isinstance(out, Mapping):
            return {**out, "loss": step_loss(out) * last_weight}
        return step_loss(out) * last_weight

    return training_step
