"""Hugging Face ``Trainer`` trained as tuned (``pip install 'autotune[hf]'``).

>>> args = training_arguments(result, "out", learning_rate=3e-4, max_steps=1000)
>>> trainer = Trainer(model, args, train_dataset=data, callbacks=[AutotuneCallback(result)])

:func:`training_arguments` holds what ``TrainingArguments`` can express: the per-device
batch, the accumulation, bf16/fp16, the optimizer by its Hugging Face name (with the
tuned optimizer's weight decay or momentum). :class:`AutotuneCallback` applies the rest
to the model when training starts: the exact per-block checkpoint mask and activation
offload (``gradient_checkpointing`` means every layer, and some models reject it), and
the key/value cache off; it puts the model back when training ends.

A ``Trainer`` step cannot be run again, so the fallback ladder does not apply here: a
step that runs out of memory raises, as it would without autotune. Optimizer offload
cannot be expressed either (use the DeepSpeed export).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from autotune.config import PAGED_OPTIMIZERS, is_factory
from autotune.errors import AutotuneWarning, ConfigError
from autotune.integrations._export import hf_settings
from autotune.integrations._export_file import HF_OPTIM_TUNED
from autotune.integrations._one_process import per_process
from autotune.result import TuneResult
from autotune.train import Applied, apply, check_finite

__all__ = ["AutotuneCallback", "training_arguments"]

log = logging.getLogger("autotune")


def training_arguments(result: TuneResult, output_dir: str, **overrides: Any) -> TrainingArguments:
    """Real ``TrainingArguments`` as ``result`` was tuned; ``overrides`` win (a warning
    says which tuned setting one of them changes).

    What ``TrainingArguments`` cannot express is a warning (:class:`AutotuneWarning`)
    that says what to do; the checkpoint mask is :class:`AutotuneCallback`'s.
    """
    _check_result(result, "training_arguments")
    settings, unsaid = hf_settings(result)
    for message in unsaid:
        warnings.warn(message, AutotuneWarning, stacklevel=2)
    changed = sorted(k for k in overrides if k in settings and overrides[k] != settings[k])
    if changed:
        warnings.warn(
            f"overrides change tuned settings ({', '.join(changed)}): the peak memory and "
            "throughput autotune measured no longer hold.",
            AutotuneWarning,
            stacklevel=2,
        )
    return TrainingArguments(output_dir=output_dir, **{**settings, **overrides})


class AutotuneCallback(TrainerCallback):
    """Applies ``result``'s checkpoint mask and activation offload to the model at the
    start of training, and undoes them at the end.

    Attributes:
        handle: The applied config while training runs (``None`` before and after).
    """

    def __init__(self, result: TuneResult) -> None:
        _check_result(result, "AutotuneCallback")
        self.result = result
        self.handle: Applied | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError("AutotuneCallback got no model from the Trainer.")
        _check_args(args, self.result)
        device = next(model.parameters()).device
        self.handle = apply(model, per_process(self.result, "the Trainer"), device=device)
        c = self.result.config
        log.info(
            "autotune: %s; checkpointed %d (%d selectively) and offloaded %d of %d blocks",
            c.describe(),
            len(c.checkpoint) + len(c.selective_checkpoint),
            len(c.selective_checkpoint),
            len(c.offload_activations),
            len(self.result.model.blocks),
        )

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ) -> None:
        """Refuse a step whose gradients are not finite (fp16's GradScaler skips those
        itself, and overflows are how it finds its scale)."""
        optimizer = kwargs.get("optimizer")
        if optimizer is not None and not args.fp16:
            check_finite(optimizer)

    def on_train_end(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ) -> None:
        if self.handle is not None:
            self.handle.undo()
            self.handle = None


def _check_result(result: object, where: str) -> None:
    if not isinstance(result, TuneResult):
        raise ConfigError(
            f"{where}() takes the TuneResult of autotune.autotune() or autotune.load(path), "
            f"got {type(result).__name__}."
        )


def _check_args(args: TrainingArguments, result: TuneResult) -> None:
    """Warn where the Trainer's arguments differ from what was tuned."""
    settings, _ = hf_settings(result)
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16")
    differ = [
        f"{k}={getattr(args, k)!r} (tuned {settings[k]!r})"
        for k in keys
        if getattr(args, k) != settings[k]
    ]
    optim = str(getattr(args.optim, "value", args.optim))
    tuned = result.config.optimizer
    same = {tuned, PAGED_OPTIMIZERS.get(tuned, tuned)}
    same |= {p for p, twin in PAGED_OPTIMIZERS.items() if twin == tuned}
    # Paged or not: the same states. A factory's optimizer is passed as Trainer(optimizers=).
    if not is_factory(tuned) and HF_OPTIM_TUNED.get(optim, optim) not in same:
        differ.append(f"optim={optim!r} (tuned {settings['optim']!r})")
    if getattr(args, "gradient_checkpointing", False) or getattr(
        args, "activation_checkpointing", False
    ):
        differ.append("activation checkpointing of every layer is on (tuned: per block)")
    if differ:
        warnings.warn(
            "the Trainer's arguments are not the tuned ones: " + "; ".join(differ) + ". Build "
            "them with autotune.integrations.transformers.training_arguments(result, ...).",
            AutotuneWarning,
            stacklevel=2,
        )
