"""A tuned result as the native settings of other trainers.

``export(result, "hf")`` gives Hugging Face ``TrainingArguments`` keyword arguments,
``"lightning"`` Lightning ``Trainer`` arguments, ``"deepspeed"`` a DeepSpeed config,
``"accelerate"`` an ``accelerate launch`` config file and ``"torchrun"`` the launch of a
data-parallel result (:mod:`autotune.integrations._export_parallel`). A knob the target
cannot express (a per-block checkpoint mask in Hugging Face, a micro-batch size in a
Lightning ``Trainer``) is never dropped silently: it is in :attr:`Export.warnings`, with
what to do instead, and written as a comment in the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.config import TrainConfig, is_factory
from autotune.errors import ConfigError
from autotune.integrations._export_file import (
    HF_OPTIM,
    LIGHTNING_PRECISION,
    Export,
    checkpoint_in_code,
    chunked_in_code,
    compiled_in_code,
    lost_offload_activations,
    offload,
    on_cpu,
    optimizer_in_code,
    origin,
    partial_mask,
)
from autotune.integrations._export_parallel import (
    accelerate_parallel,
    deepspeed_parallel,
    launch_warnings,
    to_torchrun,
)
from autotune.result import TuneResult

__all__ = [
    "LIGHTNING_PRECISION",
    "TARGETS",
    "Export",
    "export",
    "hf_settings",
    "to_accelerate",
    "to_deepspeed",
    "to_hf",
    "to_lightning",
    "to_torchrun",
]


_ADAMW = ("adamw", "adamw_fused", "adamw8bit", "paged_adamw8bit", "paged_adamw")
"""AdamW, with torch's and bitsandbytes' default weight decay of 0.01."""


def to_hf(result: TuneResult) -> Export:
    """Keyword arguments of ``transformers.TrainingArguments``.

    The checkpoint mask, activation offload and compiled blocks are applied to the model
    by ``autotune.integrations.transformers.AutotuneCallback``, block by block, never by
    ``gradient_checkpointing`` (which some models reject and which means every layer) or
    ``torch_compile`` (the whole model, shapes dynamic; a config that compiles the model
    whole, ``compile_model``, is compiled by the callback too, shapes static).
    """
    settings, warnings = hf_settings(result)
    usage = (
        "use: autotune.integrations.transformers.training_arguments(result, output_dir), "
        "HfArgumentParser(TrainingArguments).parse_yaml_file(path), "
        "or TrainingArguments(output_dir=..., **yaml.safe_load(text))"
    )
    notes = (*origin(result, "TrainingArguments"), usage, *_hf_notes(result.config))
    c = result.config
    named = [
        f"{knob} ({', '.join(blocks)})"
        for knob, blocks in (
            ("checkpoint", c.checkpoint),
            ("selective_checkpoint", c.selective_checkpoint),
            ("offload_activations", c.offload_activations),
            ("compile_blocks", c.compile_blocks),
        )
        if blocks
    ]
    if named:
        warnings.append(
            f"{' and '.join(named)}: TrainingArguments cannot name blocks: pass "
            "Trainer(callbacks=[AutotuneCallback(result)]) from "
            "autotune.integrations.transformers, which applies them to the model exactly."
        )
    if c.chunked_loss:
        warnings.append(
            "chunked_loss: pass Trainer(callbacks=[AutotuneCallback(result)]), which makes "
            "the model's loss the chunked loss while it trains (the Trainer alone computes "
            "it over the whole logits, which holds more than tuned)."
        )
    if c.compile_model:
        warnings.append(
            "compile_model: pass Trainer(callbacks=[AutotuneCallback(result)]), which "
            "compiles the model (and the loss its forward computes) as tuned, shapes "
            "static, one graph; leave torch_compile off: the model would be compiled "
            "twice, and Hugging Face's own compile cuts its graph at the loss's warning."
        )
    return Export("hf", settings, tuple(warnings), notes)


def hf_settings(result: TuneResult) -> tuple[dict[str, Any], list[str]]:
    """The ``TrainingArguments`` keywords of ``result`` and what they cannot express."""
    c = result.config
    settings: dict[str, Any] = {
        "per_device_train_batch_size": c.micro_batch_size,
        "gradient_accumulation_steps": c.grad_accum_steps,
        "bf16": c.precision == "bf16",
        "fp16": c.precision == "fp16",
        # On, the Trainer reads every micro-batch's loss on the host to leave NaN and inf
        # out of the logged mean: on a GPU, a wait for the device each micro-batch.
        "logging_nan_inf_filter": False,
    }
    if c.eval_batch_size is not None:  # the largest evaluation batch beside the state
        settings["per_device_eval_batch_size"] = c.eval_batch_size
    if not is_factory(c.optimizer):
        settings["optim"] = HF_OPTIM[c.optimizer]
    if c.optimizer in _ADAMW:
        settings["weight_decay"] = 0.01  # torch's and bitsandbytes' AdamW default, as tuned
    if c.optimizer == "sgd":
        settings["optim_args"] = "momentum=0.9"  # autotune's SGD keeps a momentum buffer
    if on_cpu(result):
        settings["use_cpu"] = True
    warnings = []
    if is_factory(c.optimizer):
        warnings.append(
            f"optimizer {c.optimizer}: TrainingArguments cannot name your factory; build "
            "the optimizer with it and pass Trainer(optimizers=(optimizer, None))."
        )
    if c.optimizer == "adafactor":
        warnings.append(
            "optimizer adafactor: Hugging Face's 'adafactor' is transformers' Adafactor, "
            "not the torch.optim.Adafactor that was tuned (same factored state, other "
            "updates); for the tuned one pass "
            "Trainer(optimizer_cls_and_kwargs=(torch.optim.Adafactor, {}))."
        )
    if c.offload_optimizer:
        warnings.append(
            "offload_optimizer: TrainingArguments cannot keep the optimizer on the host; "
            "export --to deepspeed and pass that file as deepspeed=path."
        )
    return settings, [*warnings, *launch_warnings(result, "hf")]


def _hf_notes(c: TrainConfig) -> tuple[str, ...]:
    if c.optimizer not in _ADAMW:
        return ()
    return (
        "weight_decay 0.01 is AdamW's default in torch, as tuned; the Trainer exempts "
        "biases and norm weights from it",
    )


def to_lightning(result: TuneResult) -> Export:
    """``lightning.Trainer`` arguments, under ``trainer:`` as a LightningCLI config."""
    c = result.config
    trainer: dict[str, Any] = {
        "accelerator": "cpu" if on_cpu(result) else "gpu",
        "devices": 1,
        "precision": LIGHTNING_PRECISION[c.precision],
        "accumulate_grad_batches": c.grad_accum_steps,
    }
    if c.parallel != "none":
        trainer["devices"] = c.world_size
        if c.parallel == "ddp":
            trainer["strategy"] = "ddp"
    evaluation = (
        f" and your validation DataLoader batch_size={c.eval_batch_size} at most (the "
        "largest evaluation batch that fits beside the training state)"
        if c.eval_batch_size is not None
        else ""
    )
    warnings = [
        f"micro_batch_size {c.micro_batch_size} is not a Trainer setting: give your "
        f"DataLoader batch_size={c.micro_batch_size}{evaluation}.",
        optimizer_in_code(c, "return it from LightningModule.configure_optimizers()"),
        *checkpoint_in_code(result, "the Trainer has no per-block activation checkpointing"),
        *compiled_in_code(c, "Lightning (torch.compile(model) in configure_model)"),
        *chunked_in_code(c, "your training_step"),
        *offload(
            c,
            "these Trainer settings",
            "Trainer(strategy='deepspeed_stage_2_offload') can, with DeepSpeed",
        ),
        *launch_warnings(result, "lightning"),
    ]
    usage = "use: Trainer(**yaml.safe_load(...)['trainer']), or LightningCLI --config path"
    return Export(
        "lightning",
        {"trainer": trainer},
        tuple(warnings),
        (*origin(result, "Lightning Trainer arguments"), usage),
    )


def to_deepspeed(result: TuneResult) -> Export:
    """A DeepSpeed config (JSON) for ``deepspeed.initialize(config=...)``.

    The optimizer is the one passed to ``deepspeed.initialize``; activation checkpointing
    applies to what the model wraps in ``deepspeed.checkpointing.checkpoint``.
    """
    c = result.config
    zero: dict[str, Any] = {"stage": 0}
    if c.offload_optimizer:  # ZeRO-Offload needs stage 1 or more; 2 on one device
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    settings: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": c.micro_batch_size,
        "gradient_accumulation_steps": c.grad_accum_steps,
        "bf16": {"enabled": c.precision == "bf16"},
        "fp16": {"enabled": c.precision == "fp16"},
        "zero_optimization": zero,
    }
    if c.offload_optimizer and c.optimizer not in ("adamw", "adamw_fused"):
        settings["zero_allow_untested_optimizer"] = True
    wrapped = (*c.checkpoint, *c.selective_checkpoint, *c.offload_activations)
    if wrapped:
        settings["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": bool(c.offload_activations),
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    warnings = [optimizer_in_code(c, "pass it to deepspeed.initialize(optimizer=...)")]
    if c.parallel != "none":
        warnings += deepspeed_parallel(result, settings)
    if c.offload_optimizer and c.parallel == "none":
        warnings.append(
            "offload_optimizer: with a client optimizer DeepSpeed wants its CPU Adam: pass "
            "deepspeed.ops.adam.DeepSpeedCPUAdam for AdamW."
        )
    warnings += partial_mask(result, "DeepSpeed activation checkpointing")
    if c.selective_checkpoint:
        warnings.append(
            f"selective_checkpoint ({', '.join(c.selective_checkpoint)}): DeepSpeed's "
            "activation checkpointing recomputes a whole layer; autotune kept these blocks' "
            "matrix products and attention and recomputed only the cheap ops (less memory "
            "than tuned and slower): autotune.apply(model, result) does exactly that."
        )
    if c.offload_activations:
        warnings.append(
            f"offload_activations ({', '.join(c.offload_activations)}): DeepSpeed's "
            "cpu_checkpointing moves the inputs of every checkpointed layer to the host and "
            "recomputes them; autotune kept these blocks' activations on the host without "
            "recomputing."
        )
    notes = [*origin(result, "DeepSpeed config")]
    if wrapped:
        notes.append(
            "activation checkpointing applies to the layers your model runs through "
            f"deepspeed.checkpointing.checkpoint: {', '.join(wrapped)}"
        )
    warnings += compiled_in_code(c, "DeepSpeed's compile setting")
    warnings += chunked_in_code(c, "DeepSpeed's engine")
    return Export("deepspeed", settings, tuple(warnings), tuple(notes))


def to_accelerate(result: TuneResult) -> Export:
    """An ``accelerate launch --config_file`` config (one process).

    Optimizer offload is expressed through accelerate's DeepSpeed plugin (ZeRO-2 with the
    optimizer on the CPU), which then also carries the accumulation.
    """
    c = result.config
    settings: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED" if c.offload_optimizer else "NO",
        "mixed_precision": {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[c.precision],
        "use_cpu": on_cpu(result),
        "num_machines": 1,
        "num_processes": 1,
        "machine_rank": 0,
        "debug": False,
    }
    warnings = [
        f"micro_batch_size {c.micro_batch_size} is not an accelerate setting: give your "
        f"DataLoader batch_size={c.micro_batch_size}.",
        optimizer_in_code(c, "pass it to accelerator.prepare()"),
    ]
    if c.offload_optimizer:
        settings["deepspeed_config"] = {
            "gradient_accumulation_steps": c.grad_accum_steps,
            "offload_optimizer_device": "cpu",
            "offload_param_device": "none",
            "zero_stage": 2,
            "zero3_init_flag": False,
        }
    elif c.grad_accum_steps > 1:
        warnings.append(
            f"grad_accum_steps {c.grad_accum_steps} is not in accelerate's config file: "
            f"use Accelerator(gradient_accumulation_steps={c.grad_accum_steps}) and "
            "accelerator.accumulate(model)."
        )
    if c.parallel != "none":
        warnings += accelerate_parallel(result, settings)
    elif c.checkpoint or c.selective_checkpoint:
        warnings += checkpoint_in_code(result, "accelerate has no activation checkpointing setting")
    if c.offload_activations:
        warnings.append(lost_offload_activations(c, "accelerate"))
    if c.compile_model:
        settings["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_use_dynamic": False}
    else:
        warnings += compiled_in_code(c, "accelerate's dynamo_config")
    warnings += chunked_in_code(c, "your loop")
    usage = "use: accelerate launch --config_file path train.py"
    return Export(
        "accelerate", settings, tuple(warnings), (*origin(result, "accelerate config"), usage)
    )


_EXPORTERS: dict[str, Callable[[TuneResult], Export]] = {
    "hf": to_hf,
    "lightning": to_lightning,
    "deepspeed": to_deepspeed,
    "accelerate": to_accelerate,
    "torchrun": to_torchrun,
}
TARGETS: tuple[str, ...] = tuple(_EXPORTERS)
"""The trainers :func:`export` writes settings for."""


def export(result: TuneResult, target: str, *, path: str = "tuned.yaml") -> Export:
    """The settings of ``result.config`` for ``target`` (one of :data:`TARGETS`);
    ``path`` is where the result is saved, for the settings that load it (torchrun's).

    Raises:
        ConfigError: ``target`` is unknown.
    """
    if target not in _EXPORTERS:
        raise ConfigError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}.")
    if target == "torchrun":
        return to_torchrun(result, path)
    return _EXPORTERS[target](result)
