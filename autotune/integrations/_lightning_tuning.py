"""Tuning a ``LightningModule`` through its own ``training_step``: the widest batch, the
optimizer it configures, and the module seen as a model whose forward is the step's loss.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import types
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from autotune.config import FUSED_OPTIMIZERS
from autotune.errors import BatchError, ConfigError, LossError
from autotune.train import OptimizerFactory, factory_name, sequence_length

__all__ = ["as_a_model", "fuse", "fuses", "optimizer_name", "step_loss", "widest_batch"]

_OPTIMIZERS = {  # optimizer class name -> the autotune optimizer with the same state
    "AdamW": "adamw",
    "Adam": "adamw",
    "SGD": "sgd",
    "Adafactor": "adafactor",
    "AdamW8bit": "adamw8bit",
    "PagedAdamW8bit": "paged_adamw8bit",
    "PagedAdamW": "paged_adamw",
    "PagedAdamW32bit": "paged_adamw",
}


def step_loss(out: Any) -> torch.Tensor:
    """The loss a ``training_step`` returned (a tensor, or a dict with ``"loss"``)."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            "training_step must return the loss (a tensor, or a dict with 'loss') for "
            f"Autotune to tune it; it returned {type(out).__name__}."
        )
    return loss


SCANNED = 64
"""Batches of the train loader read for the widest one to tune with."""


def widest_batch(trainer: pl.Trainer, given: Any = None) -> Any:
    """The batch to tune with, as ``training_step`` receives it: ``given``, else the
    widest of the train dataloader's first :data:`SCANNED` batches (the longest padded
    rows, where a collator pads each batch to its own longest: the one whose memory the
    budget must hold; the first of them where the batches have no sequence dimension)."""
    trainer.fit_loop.setup_data()
    loader: Any = trainer.train_dataloader
    if given is None and not isinstance(loader, torch.utils.data.DataLoader):
        raise ConfigError(
            "Autotune tunes with one train DataLoader; got "
            f"{type(loader).__name__}. Tune with autotune.autotune() instead."
        )
    batch = (
        given
        if given is not None
        else max(itertools.islice(loader, SCANNED), key=_width, default=None)
    )
    if batch is None:
        raise ConfigError("the train DataLoader yields no batch to tune with.")
    module = trainer.lightning_module
    batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def _width(batch: Any) -> int:
    """The padded length of ``batch``, 0 where it has no sequence dimension."""
    try:
        return sequence_length(batch)
    except BatchError:
        return 0


def optimizer_name(
    optimizers: list[torch.optim.Optimizer],
    module: pl.LightningModule,
    given: OptimizerFactory | str | None = None,
) -> str:
    """The optimizer to tune with: ``given`` (the user's factory); else the autotune
    optimizer whose state and step are the module's optimizer's, where autotune knows its
    class; else the module's own ``configure_optimizers`` as the factory, measured."""
    if given is not None:
        return factory_name(given)
    if len(optimizers) != 1:
        raise ConfigError(
            f"Autotune tunes modules with one optimizer; configure_optimizers returned "
            f"{len(optimizers)}."
        )
    name = type(optimizers[0]).__name__
    if name not in _OPTIMIZERS:
        return factory_name(_configured(module))
    tuned = _OPTIMIZERS[name]
    fused = tuned == "adamw" and bool(optimizers[0].defaults.get("fused"))
    return FUSED_OPTIMIZERS[tuned] if fused else tuned


def fuses(optimizer: torch.optim.Optimizer, tuned: str, name: str) -> bool:
    """Whether ``optimizer`` (the module's, tuned as ``name``) steps as ``tuned`` once
    passed to :func:`fuse`: ``tuned`` is the fused twin of ``name``, and ``optimizer`` one of
    torch's own that takes the fused kernel."""
    own = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    twin = FUSED_OPTIMIZERS.get(name) == tuned
    return twin and own and not optimizer.defaults.get("differentiable", False)


def fuse(optimizer: torch.optim.Optimizer) -> None:
    """Step ``optimizer`` with torch's fused kernel from now on, in place: the same update
    in one kernel per step, as Hugging Face's default ``adamw_torch_fused`` builds it.

    In place, so that schedulers and Lightning's references keep stepping this one; state
    restored from a checkpoint of an unfused run has its step counters moved to the
    parameters' devices, where the fused kernel reads them. Idempotent.
    """
    optimizer.defaults.update(fused=True, foreach=None)
    for group in optimizer.param_groups:
        group.update(fused=True, foreach=None)
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    for p, state in optimizer.state.items():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != p.device:
            state["step"] = step.to(p.device, torch.float32)


def _configured(module: pl.LightningModule) -> OptimizerFactory:
    """The module's ``configure_optimizers`` as a factory of (a copy of) the module, named
    by its import path."""

    def configured(model: nn.Module) -> torch.optim.Optimizer:
        return _the_optimizer(model.configure_optimizers())  # type: ignore[operator]

    configured.__module__ = type(module).__module__
    configured.__qualname__ = f"{type(module).__qualname__}.configure_optimizers"
    return configured


def _the_optimizer(conf: Any) -> torch.optim.Optimizer:
    """The optimizer of what ``configure_optimizers`` returns: an optimizer, a list or
    tuple (of optimizers, and schedulers), or a dict with ``"optimizer"``."""
    if isinstance(conf, torch.optim.Optimizer):
        return conf
    if isinstance(conf, Mapping):
        return _the_optimizer(conf.get("optimizer"))
    if isinstance(conf, (list, tuple)) and conf:
        return _the_optimizer(conf[0])
    raise ConfigError(
        f"configure_optimizers returned {type(conf).__name__}, with no optimizer in it to tune."
    )


@contextlib.contextmanager
def as_a_model(module: pl.LightningModule, trainer: pl.Trainer, sample: Any) -> Iterator[None]:
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
        return step_loss(self.training_step(batch, 0))

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
