"""Lightning: the ``Autotune`` callback (``pip install 'autotune[lightning]'``).

>>> trainer = Trainer(max_epochs=3, callbacks=[Autotune(budget_gb=24, global_batch_size=64)])
>>> trainer.fit(module)  # tunes at fit start on module.training_step, then trains as tuned

Used as Lightning's ``BatchSizeFinder`` is: at fit start it takes the first batch of the
train dataloader and tunes on a copy of the module, through the module's own
``training_step``, with the optimizer that ``configure_optimizers`` returned. Then it
applies the result: the batch-size attribute (found where ``BatchSizeFinder`` finds it:
the module, its ``hparams``, the datamodule or its ``hparams``), the dataloaders rebuilt
with it, ``accumulate_grad_batches``, the precision, and the exact per-block checkpoint
mask; and it logs the choice. The tuned config is ``callback.result``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

from autotune.errors import ConfigError, LossError
from autotune.integrations._export import to_lightning
from autotune.result import TuneResult
from autotune.space import SearchSpace
from autotune.train._applied import Applied
from autotune.train._prepare import apply
from autotune.tune import autotune

__all__ = ["Autotune"]

log = logging.getLogger("autotune")

_OPTIMIZERS = {  # optimizer class name -> the autotune optimizer with the same state
    "AdamW": "adamw",
    "Adam": "adamw",
    "SGD": "sgd",
    "Adafactor": "adafactor",
    "AdamW8bit": "adamw8bit",
}


class Autotune(pl.Callback):
    """Tune at fit start on the module's own ``training_step`` and train as tuned.

    Args:
        budget_gb: The device-memory budget in GiB.
        global_batch_size: Samples per optimizer step, kept exact with accumulation;
            ``None``: the micro-batch is the batch and its size is tuned for throughput.
        batch_arg_name: The attribute that holds the dataloaders' batch size.
        space, n_trials, timeout_s, seed, storage, study_name: As for
            :func:`autotune.autotune`. The space's optimizer is always the one the module
            configures, never offloaded: Lightning steps that one, on the device.

    Attributes:
        result: The tuned result, after fit start.
    """

    def __init__(
        self,
        budget_gb: float,
        global_batch_size: int | None = None,
        *,
        batch_arg_name: str = "batch_size",
        space: SearchSpace | None = None,
        n_trials: int | None = None,
        timeout_s: float | None = None,
        seed: int = 0,
        storage: str | None = None,
        study_name: str | None = None,
    ) -> None:
        self.budget_gb = budget_gb
        self.global_batch_size = global_batch_size
        self.batch_arg_name = batch_arg_name
        self.space = space
        self.tune_kwargs: dict[str, Any] = dict(
            n_trials=n_trials,
            timeout_s=timeout_s,
            seed=seed,
            storage=storage,
            study_name=study_name,
        )
        self.result: TuneResult | None = None
        self.handle: Applied | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"Autotune sets the batch size through the attribute {self.batch_arg_name!r}, "
                "which neither the module, its hparams, the datamodule nor its hparams has; "
                "give your DataLoader batch_size=self.batch_size, or pass batch_arg_name=."
            )
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "Autotune tunes modules with automatic optimization; with manual "
                "optimization, tune with autotune.autotune() and train with autotune.apply()."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        sample = _first_batch(trainer)
        # Lightning steps the optimizer configure_optimizers returned, on the device.
        space = dataclasses.replace(
            self.space or SearchSpace(),
            optimizers=(_optimizer_name(trainer.optimizers),),
            offload_optimizer=False,
        )
        with _as_a_model(pl_module, trainer, sample):
            result = autotune(
                pl_module,
                sample,
                self.budget_gb,
                global_batch_size=self.global_batch_size,
                device=device,
                space=space,
                **self.tune_kwargs,
            )
        self.result = result
        c = result.config
        before = lightning_getattr(pl_module, self.batch_arg_name)
        lightning_setattr(pl_module, self.batch_arg_name, c.micro_batch_size)
        _reload_dataloaders(trainer)
        trainer.accumulate_grad_batches = c.grad_accum_steps
        precision = to_lightning(result).settings["trainer"]["precision"]
        trainer.strategy.precision_plugin = _precision(precision, device)
        self.handle = apply(pl_module, c, device=device)
        log.info(
            "autotune: %s=%s (was %s), accumulate_grad_batches=%d, precision %s, "
            "%d of %d blocks checkpointed; predicted peak %.1f MiB, %.1f samples/s",
            self.batch_arg_name,
            c.micro_batch_size,
            before,
            c.grad_accum_steps,
            c.precision,
            len(c.checkpoint),
            len(result.model.blocks),
            result.predicted.peak_bytes / 2**20,
            result.measured.samples_per_s,
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.handle is not None:
            self.handle.undo()
            self.handle = None


def _first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the train dataloader, as ``training_step`` receives it."""
    trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ConfigError(
            "Autotune tunes with one train DataLoader; got "
            f"{type(loader).__name__}. Tune with autotune.autotune() instead."
        )
    batch = next(iter(loader))
    module = trainer.lightning_module
    batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def _optimizer_name(optimizers: list[torch.optim.Optimizer]) -> str:
    """The autotune optimizer whose state costs what the module's optimizer's does."""
    if len(optimizers) != 1:
        raise ConfigError(
            f"Autotune tunes modules with one optimizer; configure_optimizers returned "
            f"{len(optimizers)}."
        )
    name = type(optimizers[0]).__name__
    if name not in _OPTIMIZERS:
        warnings.warn(
            f"Autotune does not know the state of optimizer {name}; it tunes as for AdamW "
            "(two states per parameter). Pass space=SearchSpace(optimizers=[...]) to say.",
            stacklevel=3,
        )
    return _OPTIMIZERS.get(name, "adamw")


@contextlib.contextmanager
def _as_a_model(module: pl.LightningModule, trainer: pl.Trainer, sample: Any) -> Iterator[None]:
    """While tuning, ``module(batch)`` is ``module.training_step(batch, 0)``'s loss, copies
    of the module share the trainer instead of copying it, and ``self.log`` is silent."""
    kind = type(sample)
    names = ("forward", "log", "log_dict")
    saved: dict[str, Any] = {k: module.__dict__[k] for k in names if k in module.__dict__}

    def forward(self: pl.LightningModule, *args: Any, **kwargs: Any) -> torch.Tensor:
        if issubclass(kind, Mapping):
            batch: Any = kwargs
        elif issubclass(kind, (tuple, list)):
            batch = list(args) if kind is list else tuple(args)
        else:
            batch = args[0]
        out = self.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise LossError(
                "training_step must return the loss (a tensor, or a dict with 'loss') for "
                f"Autotune to tune it; it returned {type(out).__name__}."
            )
        return loss

    def quiet(self: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        return None

    def deepcopy(memo: dict[int, Any]) -> pl.LightningModule:
        memo[id(trainer)] = trainer
        new = object.__new__(type(module))
        memo[id(module)] = new
        state = {k: v for k, v in module.__dict__.items() if k != "__deepcopy__"}
        new.__dict__.update(copy.deepcopy(state, memo))
        return new

    # On the instance, as the checkpoint wrappers are: copies get them, the class is untouched.
    module.__dict__["forward"] = types.MethodType(forward, module)
    module.__dict__["log"] = types.MethodType(quiet, module)
    module.__dict__["log_dict"] = types.MethodType(quiet, module)
    module.__dict__["__deepcopy__"] = deepcopy
    try:
        yield
    finally:
        for k in ("forward", "log", "log_dict", "__deepcopy__"):
            module.__dict__.pop(k, None)
        module.__dict__.update(saved)


def _reload_dataloaders(trainer: pl.Trainer) -> None:
    """Make the fit loop build its dataloaders again, with the new batch size."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.epoch_loop.val_loop._combined_loader = None


def _precision(precision: str, device: torch.device) -> Precision:
    """Lightning's precision plugin for one of its precision strings."""
    if precision == "32-true":
        return Precision()
    return MixedPrecision(precision, device.type)  # type: ignore[arg-type]
