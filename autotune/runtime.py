"""``prepare()``: turn a model and a :class:`TrainConfig` into a runner that trains as tuned.

Tuning profiles and verifies with this very runner, so what was measured is what runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from . import batch as batching
from .config import TrainConfig, TuneResult
from .errors import BlockError, ConfigError
from .loss import LossFn, call_model, compute_loss
from .optimizers import build_optimizer

__all__ = ["Runner", "apply_checkpointing", "prepare", "remove_checkpointing"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_ORIGINAL = "_autotune_original_forward"


class Runner:
    """Trains a prepared model: one :meth:`step` is one optimizer step.

    Attributes:
        model: The model, on ``device``, with the config's checkpointing applied.
        optimizer: The optimizer the config names.
        config: The configuration in use.
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
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.loss_fn = loss_fn
        self.lr = lr
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no parameters that require grad: nothing to train.")
        self.optimizer = build_optimizer(config.optimizer, params, lr)
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step over ``batch``, in micro-batches of ``micro_batch_size``.

        The batch normally holds ``effective_batch_size`` samples; any size works, and the
        gradient is that of the mean loss over the whole batch either way.

        Returns:
            The mean loss over the batch (a detached scalar tensor, not synchronised).
        """
        n = batching.batch_size(batch)
        total = torch.zeros((), device=self.device)
        for chunk in batching.split(batch, self.config.micro_batch_size):
            weight = batching.batch_size(chunk) / n
            total += self.forward_backward(chunk, weight)
        self.optimizer_step()
        return total

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
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context of the config's precision (a no-op for fp32)."""
        dtype = _DTYPES.get(self.config.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)


def prepare(
    model: nn.Module,
    config: TrainConfig | TuneResult,
    *,
    lr: float = 3e-4,
    loss_fn: LossFn | None = None,
    device: torch.device | str | None = None,
) -> Runner:
    """Make ``model`` train exactly as ``config`` says.

    The model is moved to the device, put in train mode, its checkpointed blocks are
    wrapped (undo with :func:`remove_checkpointing`), and a Hugging Face model's
    ``config.use_cache`` is turned off (a key/value cache is for generation, not training).

    Args:
        model: The model to train (modified in place).
        config: A :class:`TrainConfig`, or a :class:`TuneResult` (its ``config``).
        lr: Learning rate of the optimizer.
        loss_fn: ``loss_fn(output, batch) -> scalar``; see :mod:`autotune.loss`.
        device: Where to train; default: the device a result was tuned on if it is
            available here, else CUDA if available, else CPU.
    """
    if isinstance(config, TuneResult):
        result: TuneResult | None = config
        config = config.config
    else:
        result = None
    if not isinstance(config, TrainConfig):
        raise ConfigError(
            f"prepare() takes a TrainConfig or a TuneResult, got {type(config).__name__}; "
            "load a YAML file with autotune.load(path)."
        )
    target = _default_device(device, result)
    model.to(target)
    model.train()
    _disable_kv_cache(model)
    remove_checkpointing(model)
    apply_checkpointing(model, config.checkpoint)
    for p in model.parameters():
        p.grad = None
    return Runner(model, config, lr=lr, loss_fn=loss_fn, device=target)


def _default_device(device: torch.device | str | None, result: TuneResult | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if result is not None:
        tuned = torch.device(result.target.device)
        if tuned.type == "cpu" or (tuned.type == "cuda" and torch.cuda.is_available()):
            return tuned
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _disable_kv_cache(model: nn.Module) -> None:
    """Training needs no key/value cache; Hugging Face models build one by default.

    The cache holds memory through the step and is appended to again when a checkpointed
    layer recomputes, so Hugging Face turns it off for gradient checkpointing; so do we.
    """
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]


def apply_checkpointing(model: nn.Module, names: Sequence[str]) -> None:
    """Recompute the activations of the named blocks in backward (non-reentrant checkpoint).

    Raises:
        BlockError: a name is not a submodule of ``model``; then no block is wrapped.
    """
    modules = []
    for name in names:  # resolve every name first, so that an error leaves the model as it was
        try:
            modules.append(model.get_submodule(name))
        except AttributeError:
            raise BlockError(
                f"the config checkpoints block {name!r}, which this model does not have; "
                "was the config tuned for another model?"
            ) from None
    for module in modules:
        if _ORIGINAL in module.__dict__:
            continue
        original = module.forward
        module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
        module.forward = functools.partial(_checkpointed_forward, original)


def remove_checkpointing(model: nn.Module) -> None:
    """Undo :func:`apply_checkpointing` on every block of ``model``."""
    for module in model.modules():
        if _ORIGINAL not in module.__dict__:
            continue
        previous = module.__dict__.pop(_ORIGINAL)
        if previous is None:
            del module.forward
        else:
            module.forward = previous


# Keyword arguments through which Hugging Face layers read and write a key/value cache.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    # A cache written in the forward would be read (or written again) by the recompute,
    # which then differs from the original; Hugging Face drops it for checkpointed layers.
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    return _checkpoint(forward, *args, use_reentrant=False, **kwargs)
