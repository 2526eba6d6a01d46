"""Hugging Face ``Trainer`` trained as tuned (``pip install 'autotune[hf]'``).

>>> args = training_arguments(result, "out", learning_rate=3e-4, max_steps=1000)
>>> trainer = Trainer(model, args, train_dataset=data, callbacks=[AutotuneCallback(result)])

:func:`training_arguments` holds what ``TrainingArguments`` can express: the per-device
batch, the accumulation, bf16/fp16, the optimizer by its Hugging Face name (with the
tuned optimizer's weight decay or momentum). :class:`AutotuneCallback` applies the rest
to the model when training starts: the exact per-block checkpoint mask and activation
offload (``gradient_checkpointing`` means every layer, and some models reject it), and
the key/value cache off; it puts the model back when training ends.

The evaluation batch (``per_device_eval_batch_size``) is the largest that fits beside the
training state, measured; the callback lowers one that asks for more.

A ``Trainer`` step cannot be run again, so the fallback ladder does not apply here: a
step that runs out of memory raises, as it would without autotune. Optimizer offload
cannot be expressed either (use the DeepSpeed export).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from autotune.config import PAGED_OPTIMIZERS, is_factory
from autotune.errors import ConfigError, warn
from autotune.integrations._export import hf_settings
from autotune.integrations._export_file import HF_OPTIM_TUNED
from autotune.integrations._one_process import per_process
from autotune.result import TuneResult
from autotune.train import Applied, LoopRefusals, apply

__all__ = ["AutotuneCallback", "sample_batch", "training_arguments"]

log = logging.getLogger("autotune")


def training_arguments(
    result: TuneResult,
    output_dir: str,
    *,
    args_class: type[TrainingArguments] = TrainingArguments,
    **overrides: Any,
) -> TrainingArguments:
    """Real ``TrainingArguments`` as ``result`` was tuned; ``overrides`` win (a warning
    says which tuned setting one of them changes). ``args_class``: a subclass to build
    instead, e.g. TRL's ``SFTConfig`` (with its own settings, ``packing=True``, among the
    overrides).

    What ``TrainingArguments`` cannot express is a warning (:class:`AutotuneWarning`)
    that says what to do; the checkpoint mask is :class:`AutotuneCallback`'s.
    """
    _check_result(result, "training_arguments")
    settings, unsaid = hf_settings(result)
    for message in unsaid:
        warn(message)
    # An evaluation batch other than the tuned one: the callback lowers one too large.
    # The logged loss's NaN filter is no tuned setting (a read on the host each
    # micro-batch, left off): the user's to turn on.
    untuned = ("per_device_eval_batch_size", "logging_nan_inf_filter")
    tuned = {k: v for k, v in settings.items() if k not in untuned}
    changed = sorted(k for k in overrides if k in tuned and overrides[k] != tuned[k])
    if changed:
        warn(
            f"overrides change tuned settings ({', '.join(changed)}): the peak memory and "
            "throughput autotune measured no longer hold.",
        )
    # The callback applies the tuned per-block mask: not every layer (TRL's SFTConfig
    # checkpoints every layer unless told not to).
    for f in dataclasses.fields(args_class):
        if f.name in ("gradient_checkpointing", "activation_checkpointing") and f.default is True:
            settings[f.name] = False
    return args_class(output_dir=output_dir, **{**settings, **overrides})


def sample_batch(trainer: Any) -> dict[str, Any]:
    """The first batch ``trainer``'s own dataloader makes, as its training step passes it
    to the model: the sample to tune with. Its collator decides the batch's shape (TRL's
    packing makes rows of ``max_length`` from several sequences), and TRL's ``SFTTrainer``
    computes its loss through the fused LM head it puts on the model (per-token
    log-probabilities in chunks, never the whole logits), which the batch then asks for
    (``fused_lm_head=True``), so that the tuned step is the trainer's."""
    batch = dict(next(iter(trainer.get_train_dataloader())))
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # TRL keeps the model's own signature on its patched forward (functools.wraps): the
    # argument shows in the code.
    code = getattr(getattr(base.forward, "__func__", base.forward), "__code__", None)
    fused = code is not None and "fused_lm_head" in code.co_varnames
    return {**batch, "fused_lm_head": True} if fused else batch


class AutotuneCallback(TrainerCallback):
    """Applies ``result``'s checkpoint mask, activation offload and compiled blocks (or
    the model compiled whole) to the model at the start of training, and undoes them at
    the end.

    Attributes:
        handle: The applied config while training runs (``None`` before and after).
    """

    def __init__(self, result: TuneResult) -> None:
        _check_result(result, "AutotuneCallback")
        self.result = result
        self.handle: Applied | None = None
        self._refusals: LoopRefusals | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError("AutotuneCallback got no model from the Trainer.")
        _check_args(args, self.result)
        _fit_evaluation(args, self.result.config.eval_batch_size)
        device = next(model.parameters()).device
        self.handle = apply(model, per_process(self.result, "the Trainer"), device=device)
        self._refusals = LoopRefusals(device)
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
        """Refuse a step whose gradients are not finite, on the device, where the
        optimizer's fused kernel can (see :class:`~autotune.train.LoopRefusals`; fp16's
        GradScaler skips those steps itself, and overflows are how it finds its scale)."""
        optimizer = kwargs.get("optimizer")
        if optimizer is not None and self._refusals is not None and not args.fp16:
            # accelerate's wrapper steps the optimizer it holds
            self._refusals.before_step(getattr(optimizer, "optimizer", optimizer))

    def on_optimizer_step(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ) -> None:
        """Say a refused step once the device's verdict has reached the host, and steps
        run eagerly past dynamo's recompile limit."""
        if self.handle is not None:
            self.handle.recompiles.check()
        if self._refusals is not None:
            self._refusals.after_step()

    def on_train_end(
        self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any
    ) -> None:
        if self._refusals is not None:
            self._refusals.disarm()
            self._refusals = None
        if self.handle is not None:
            self.handle.undo()
            self.handle = None


def _fit_evaluation(args: TrainingArguments, fits: int | None) -> None:
    """Lower the evaluation batch to the largest that fits beside the training state,
    where the arguments ask for more (an evaluation that would run out of memory)."""
    asked = args.per_device_eval_batch_size
    if fits is None or asked <= fits:
        return
    warn(
        f"per_device_eval_batch_size={asked} does not fit the budget beside the training "
        f"state; evaluating with {fits}, the largest that does.",
    )
    args.per_device_eval_batch_size = fits


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
    if result.config.compile_model and getattr(args, "torch_compile", False):
        differ.append("torch_compile is on (the callback compiles the model as tuned)")
    if differ:
        warn(
            "the Trainer's arguments are not the tuned ones: " + "; ".join(differ) + ". Build "
            "them with autotune.integrations.transformers.training_arguments(result, ...).",
        )
