"""Lightning: the ``Autotune`` callback (``pip install 'autotune[lightning]'``).

>>> trainer = Trainer(max_epochs=3, callbacks=[Autotune(budget_gb=24, global_batch_size=64)])
>>> trainer.fit(module)  # tunes at fit start on module.training_step, then trains as tuned

Used as Lightning's ``BatchSizeFinder`` is: at fit start it takes the widest of the train
dataloader's first batches (or the ``sample_batch`` given) and tunes on a copy of the
module, through the module's own ``training_step``, with the optimizer that
``configure_optimizers`` returned. Then it applies the result: the batch-size attribute
(found where ``BatchSizeFinder`` finds it: the module, its ``hparams``, the datamodule or
its ``hparams``), the dataloaders rebuilt with it, ``accumulate_grad_batches``, the
precision, and the exact per-block checkpoint mask; and it logs the choice. The tuned
config is ``callback.result``.

Where ``training_step``'s loss is a mean over label tokens (the module's Hugging Face
language model's own loss, or ``loss_mean=`` says so), the micro-batches of a step weigh
their tokens, as one batch of them all does, where Lightning's own accumulation weighs
every micro-batch the same (see :mod:`autotune.integrations._lightning_tokens`).

On one device, a step that runs out of device memory falls back down the result's
fallbacks and runs again (see :mod:`autotune.integrations._lightning_fallback`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

from autotune.errors import ConfigError, warn
from autotune.integrations._lightning_fallback import Ladder, precision_plugin
from autotune.integrations._lightning_tokens import TokenWindows, weighed_step
from autotune.integrations._lightning_tuning import (
    as_a_model,
    fuse,
    fuses,
    optimizer_name,
    widest_batch,
)
from autotune.integrations._one_process import per_process
from autotune.result import TuneResult
from autotune.space import SearchSpace
from autotune.train import (
    Applied,
    LoopRefusals,
    LossMean,
    OptimizerFactory,
    apply,
    check_loss_mean,
    own_mean,
)
from autotune.tuning import TuneOptions, tune

__all__ = ["Autotune"]

log = logging.getLogger("autotune")


class Autotune(pl.Callback):
    """Tune at fit start on the module's own ``training_step`` and train as tuned.

    Args:
        budget_gb: The device-memory budget in GiB.
        global_batch_size: Samples per optimizer step, kept exact with accumulation;
            ``None``: the micro-batch is the batch and its size is tuned for throughput.
        batch_arg_name: The attribute that holds the dataloaders' batch size.
        eval_batch_arg_name: The attribute that holds the validation DataLoader's batch
            size, set to the largest evaluation batch that fits beside the training state
            (measured); ``None``: a validation loader with a larger batch is warned of.
        optimizer: The factory the module's ``configure_optimizers`` builds its optimizer
            with (as for :func:`autotune.autotune`); default: the module's optimizer, by
            its class where autotune knows it (AdamW, SGD, ...), else
            ``configure_optimizers`` itself, on a copy of the module, measured.
        sample_batch: The batch to tune with, as the train loader yields it (a batch at
            the longest length you train on); default: the widest of the loader's first
            64 batches.
        loss_mean: What ``training_step``'s loss is a mean over (``"samples"``,
            ``"tokens"``, ``"next_tokens"``: see :func:`autotune.prepare`), so what each
            micro-batch weighs in a step; default: the own loss's of the one Hugging
            Face language model the module holds, else samples.
        space, n_trials, timeout_s, seed, storage, study_name: As for
            :func:`autotune.autotune`. The space's optimizer is always the one the module
            configures, never offloaded: Lightning steps that one, on the device. Where
            the module's is torch's ``AdamW`` (or ``Adam``) and the tuner chose torch's
            fused kernel for it (the same update, faster), the module's optimizer is
            made to step fused, in place, as Hugging Face's default
            ``adamw_torch_fused`` does; the log says so.

    Attributes:
        result: The tuned result, after fit start.
        handle: The result applied to the module while fit runs (``None`` after).
        ladder: The fallback ladder in Lightning's loop while fit runs, when the result
            has fallbacks and the trainer one device.
    """

    def __init__(
        self,
        budget_gb: float,
        global_batch_size: int | None = None,
        *,
        batch_arg_name: str = "batch_size",
        eval_batch_arg_name: str | None = None,
        optimizer: OptimizerFactory | str | None = None,
        loss_mean: LossMean | None = None,
        sample_batch: Any = None,
        space: SearchSpace | None = None,
        n_trials: int | None = None,
        timeout_s: float | None = None,
        seed: int = 0,
        storage: str | None = None,
        study_name: str | None = None,
    ) -> None:
        self.batch_arg_name = batch_arg_name
        self.eval_batch_arg_name = eval_batch_arg_name
        self.optimizer = optimizer
        check_loss_mean(loss_mean)  # now, not at fit start
        self.loss_mean = loss_mean
        self.sample_batch = sample_batch
        self.options = TuneOptions(
            budget_gb=budget_gb,
            global_batch_size=global_batch_size,
            space=space or SearchSpace(),
            n_trials=n_trials,
            timeout_s=timeout_s,
            seed=seed,
            storage=storage,
            study_name=study_name,
        )
        """The tuner's options; the device and the optimizer are the trainer's at fit start."""
        self.result: TuneResult | None = None
        self.handle: Applied | None = None
        self.ladder: Ladder | None = None
        self._given: TuneResult | None = None
        self._fused = False
        """Whether the module's optimizer was made to step fused, as tuned."""
        self._refusals: LoopRefusals | None = None
        self._windows: TokenWindows | None = None
        """The train loader read a step ahead, where micro-batches weigh their tokens."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"Autotune sets the batch size through the attribute {self.batch_arg_name!r}, "
                "which neither the module, its hparams, the datamodule nor its hparams has; "
                "give your DataLoader batch_size=self.batch_size, or pass batch_arg_name=."
            )
        named = self.eval_batch_arg_name
        if named is not None and not lightning_hasattr(pl_module, named):
            raise ConfigError(
                f"Autotune sets the evaluation batch size through the attribute {named!r}, "
                "which neither the module, its hparams, the datamodule nor its hparams has; "
                f"give your validation DataLoader batch_size=self.{named}."
            )
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "Autotune tunes modules with automatic optimization; with manual "
                "optimization, tune with autotune.autotune() and train with autotune.apply()."
            )

    @classmethod
    def from_result(cls, result: TuneResult, *, batch_arg_name: str = "batch_size") -> Autotune:
        """A callback that applies ``result``, tuned before on this module (an earlier
        fit's ``callback.result``, or one saved and read back with ``autotune.load``),
        without tuning again."""
        callback = cls(
            result.budget_bytes / 2**30,
            result.config.effective_batch_size,
            batch_arg_name=batch_arg_name,
        )
        callback._given = result
        return callback

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        optimizer = optimizer_name(trainer.optimizers, pl_module, self.optimizer)
        result = (
            self._given if self._given is not None else self._tune(trainer, pl_module, optimizer)
        )
        c = result.config
        self._fused = (
            fuses(trainer.optimizers[0], c.optimizer, optimizer) if trainer.optimizers else False
        )
        if self._fused:  # the module's AdamW, stepped with the kernel it was tuned with
            fuse(trainer.optimizers[0])
            log.info("autotune: the module's %s steps fused, as tuned (%s)", optimizer, c.optimizer)
            optimizer = c.optimizer
        if (c.optimizer, c.offload_optimizer) != (optimizer, False):
            raise ConfigError(
                f"the result was tuned for {c.describe()}, but Lightning steps the module's "
                f"own optimizer on the device ({optimizer}); let the callback tune the "
                f"module with it: Autotune(budget_gb={result.budget_bytes / 2**30:.4g}, "
                f"global_batch_size={c.effective_batch_size}) in place of "
                "Autotune.from_result(...)."
            )
        self.result = result
        before = lightning_getattr(pl_module, self.batch_arg_name)
        lightning_setattr(pl_module, self.batch_arg_name, c.micro_batch_size)
        if self.eval_batch_arg_name is not None and c.eval_batch_size is not None:
            lightning_setattr(pl_module, self.eval_batch_arg_name, c.eval_batch_size)
        _reload_dataloaders(trainer)
        trainer.accumulate_grad_batches = c.grad_accum_steps
        trainer.strategy.precision_plugin = precision_plugin(c, device)
        # Several processes would have to fall back together: one device only. Lightning's
        # strategy does DDP itself.
        local = result if trainer.world_size == 1 and c.parallel == "none" else None
        mean = self.loss_mean or _held_mean(pl_module)
        self.handle = apply(
            pl_module, local or per_process(result, "Lightning"), device=device, loss_mean=mean
        )
        self._refusals = LoopRefusals(device)
        _free_grads_first(trainer)
        self._weigh_tokens(pl_module, self.handle)
        if self.handle.fallbacks:
            self.ladder = Ladder(trainer, self.handle)
        log.info(
            "autotune: %s=%s (was %s), accumulate_grad_batches=%d, precision %s, "
            "%d of %d blocks checkpointed (%d selectively); predicted peak %.1f MiB, "
            "%.1f samples/s %s",
            self.batch_arg_name,
            c.micro_batch_size,
            before,
            c.grad_accum_steps,
            c.precision,
            len(c.checkpoint) + len(c.selective_checkpoint),
            len(result.model.blocks),
            len(c.selective_checkpoint),
            result.predicted.peak_bytes / 2**20,
            (result.measured or result.predicted).samples_per_s,
            "measured" if result.measured else "predicted, not run",
        )

    def _weigh_tokens(self, module: pl.LightningModule, handle: Applied) -> None:
        """Where the loss is a mean over label tokens and a step accumulates, weigh each
        batch's loss by its share of the step's tokens (read a window ahead)."""
        offset, steps = handle.token_offset, handle.config.grad_accum_steps
        if offset is None or steps == 1:
            return
        self._windows = TokenWindows(None, steps, offset, float("inf"))
        module.__dict__["training_step"] = weighed_step(module, self._windows)
        if self.loss_mean is None:
            log.info(
                "autotune: micro-batches weigh their label tokens (the loss of the module's "
                "%s is a mean over them); pass Autotune(loss_mean='samples') if "
                "training_step's loss is a mean over samples",
                type(_held_model(module)).__name__,
            )

    def _tune(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: str) -> TuneResult:
        """Tune on the widest of the first batches, through the module's ``training_step``."""
        sample = widest_batch(trainer, self.sample_batch)
        # Lightning steps the optimizer configure_optimizers returned, on the device.
        space = dataclasses.replace(
            self.options.space, optimizers=(optimizer,), offload_optimizer=False
        )
        options = self.options.replace(device=trainer.strategy.root_device, space=space)
        with as_a_model(module, trainer, sample):
            return tune(module, sample, options)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fused:  # again: a checkpoint's optimizer state, restored after fit start
            fuse(trainer.optimizers[0])

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read the epoch's train loader a step ahead, where micro-batches weigh their
        tokens (the loader, made again each epoch where Lightning reloads it)."""
        windows = self._windows
        combined = trainer.fit_loop._combined_loader
        if windows is None or combined is None:
            return
        loaders = combined.flattened
        if len(loaders) != 1:
            raise ConfigError(
                "Autotune weighs micro-batches by their label tokens over one train "
                f"loader; the fit has {len(loaders)}. Pass Autotune(loss_mean='samples') "
                "to weigh them by their samples."
            )
        windows.limit = trainer.num_training_batches
        if not isinstance(loaders[0], TokenWindows):
            windows.loader = loaders[0]
            combined.flattened = [windows]
            # Lightning may have begun the epoch's iteration as it set the loader up:
            # that iterator is read through the windows too (no batch drawn from it yet).
            live = getattr(combined._iterator, "iterators", None)
            if live:
                live[0] = windows.windowed(live[0])

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fits = self.result.config.eval_batch_size if self.result is not None else None
        loaders = trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        asked = max((getattr(d, "batch_size", None) or 0 for d in loaders), default=0)
        if fits is not None and asked > fits:
            warn(
                f"the validation DataLoader's batch_size={asked} does not fit the budget "
                f"beside the training state; the largest that does is {fits}: build it with "
                "that, or pass Autotune(eval_batch_arg_name=...) to have it set.",
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.ladder is not None:
            self.ladder.updating = True
        # A non-finite step is refused on the device, where the optimizer's fused kernel
        # can (16-mixed's GradScaler skips those itself).
        if self._refusals is not None and not str(trainer.precision).startswith("16"):
            self._refusals.before_step(optimizer)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        if self.handle is not None:
            self.handle.recompiles.check()
        if self._refusals is not None:  # after the step, if this batch ended one
            self._refusals.after_step()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove(trainer)

    def _remove(self, trainer: pl.Trainer) -> None:
        """Give the trainer and the module back as they were (the weights as trained)."""
        vars(trainer.fit_loop.epoch_loop.automatic_optimization).pop("_make_zero_grad_fn", None)
        if self._refusals is not None:
            self._refusals.disarm()
            self._refusals = None
        if self.ladder is not None:
            self.ladder.remove()
            self.ladder = None
        vars(trainer.lightning_module).pop("training_step", None)  # a weighed step
        combined = trainer.fit_loop._combined_loader
        if self._windows is not None and combined is not None:
            combined.flattened = [
                d.loader if isinstance(d, TokenWindows) else d for d in combined.flattened
            ]
        self._windows = None
        if self.handle is not None:
            self.handle.undo()
            self.handle = None


def _held_model(module: pl.LightningModule) -> torch.nn.Module | None:
    """The one Hugging Face language model (or token classifier) among ``module``'s
    children whose own loss is a token mean, if it holds exactly one."""
    held = [m for m in module.children() if own_mean(m) is not None]
    return held[0] if len(held) == 1 else None


def _held_mean(module: pl.LightningModule) -> LossMean | None:
    """What the loss of the model ``module`` holds is a mean over (:func:`_held_model`);
    ``None``: samples."""
    model = _held_model(module)
    return None if model is None else own_mean(model)


def _reload_dataloaders(trainer: pl.Trainer) -> None:
    """Make the fit loop build its dataloaders again, with the new batch size."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.epoch_loop.val_loop._combined_loader = None


def _free_grads_first(trainer: pl.Trainer) -> None:
    """Free the last step's gradients before the next step's first forward, not after it.

    Lightning zeroes them in the closure, between ``training_step`` and the backward, so
    that in the first forward of every step they are alive with its activations: memory
    the tuned peak does not hold (the runner frees them as soon as the optimizer stepped).
    The same hooks (``on_before_zero_grad``, ``optimizer_zero_grad``) run, before the
    step instead of within it.
    """
    optimization = trainer.fit_loop.epoch_loop.automatic_optimization
    make = optimization._make_zero_grad_fn

    def at_once(batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        zero_grad = make(batch_idx, optimizer)
        if zero_grad is not None:
            zero_grad()

    optimization._make_zero_grad_fn = at_once  # type: ignore[method-assign]
