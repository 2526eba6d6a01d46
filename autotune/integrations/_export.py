"""A tuned result as the native settings of other trainers.

``export(result, "hf")`` gives Hugging Face ``TrainingArguments`` keyword arguments,
``"lightning"`` Lightning ``Trainer`` arguments, ``"deepspeed"`` a DeepSpeed config and
``"accelerate"`` an ``accelerate launch`` config file. A knob the target cannot express (a
per-block checkpoint mask in Hugging Face, a micro-batch size in a Lightning ``Trainer``)
is never dropped silently: it is in :attr:`Export.warnings`, with what to do instead, and
written as a comment in the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from autotune._format import format_bytes
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.integrations._export_parallel import (
    accelerate_parallel,
    deepspeed_parallel,
    launch_warnings,
    torchrun_command,
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


@dataclass(frozen=True)
class Export:
    """Settings for one trainer, and what they leave out."""

    target: str
    """``hf``, ``lightning``, ``deepspeed``, ``accelerate`` or ``torchrun``."""
    settings: dict[str, Any]
    """The native settings as plain data: exactly what the file holds."""
    warnings: tuple[str, ...] = ()
    """Knobs the settings cannot express, each saying what to do instead."""
    notes: tuple[str, ...] = ()
    """Comments for the file: where it comes from and how to use it."""

    @property
    def text(self) -> str:
        """The file: YAML with comments, or JSON (DeepSpeed) with a ``comment`` key."""
        lines = [*self.notes, *(f"WARNING: {w}" for w in self.warnings)]
        if self.target == "torchrun":  # a shell command
            return "".join(f"# {line}\n" for line in lines) + str(self.settings["command"]) + "\n"
        if self.target == "deepspeed":  # JSON has no comments; DeepSpeed ignores this key
            return json.dumps({"comment": lines, **self.settings}, indent=2) + "\n"
        header = "".join(f"# {line}\n" for line in lines)
        return header + yaml.safe_dump(self.settings, sort_keys=False)


def to_hf(result: TuneResult) -> Export:
    """Keyword arguments of ``transformers.TrainingArguments``.

    The checkpoint mask and activation offload are applied to the model by
    ``autotune.integrations.transformers.AutotuneCallback``, block by block, never by
    ``gradient_checkpointing``, which some models reject and which means every layer.
    """
    settings, warnings = hf_settings(result)
    usage = (
        "use: autotune.integrations.transformers.training_arguments(result, output_dir), "
        "HfArgumentParser(TrainingArguments).parse_yaml_file(path), "
        "or TrainingArguments(output_dir=..., **yaml.safe_load(text))"
    )
    notes = (*_origin(result, "TrainingArguments"), usage, *_hf_notes(result.config))
    c = result.config
    named = [
        f"{knob} ({', '.join(blocks)})"
        for knob, blocks in (
            ("checkpoint", c.checkpoint),
            ("offload_activations", c.offload_activations),
        )
        if blocks
    ]
    if named:
        warnings.append(
            f"{' and '.join(named)}: TrainingArguments cannot name blocks: pass "
            "Trainer(callbacks=[AutotuneCallback(result)]) from "
            "autotune.integrations.transformers, which applies them to the model exactly."
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
        "optim": _HF_OPTIM[c.optimizer],
    }
    if c.optimizer in ("adamw", "adamw8bit"):
        settings["weight_decay"] = 0.01  # torch's and bitsandbytes' AdamW default, as tuned
    if c.optimizer == "sgd":
        settings["optim_args"] = "momentum=0.9"  # autotune's SGD keeps a momentum buffer
    if _on_cpu(result):
        settings["use_cpu"] = True
    warnings = []
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
    if c.optimizer not in ("adamw", "adamw8bit"):
        return ()
    return (
        "weight_decay 0.01 is AdamW's default in torch, as tuned; the Trainer exempts "
        "biases and norm weights from it",
    )


def to_lightning(result: TuneResult) -> Export:
    """``lightning.Trainer`` arguments, under ``trainer:`` as a LightningCLI config."""
    c = result.config
    trainer: dict[str, Any] = {
        "accelerator": "cpu" if _on_cpu(result) else "gpu",
        "devices": 1,
        "precision": LIGHTNING_PRECISION[c.precision],
        "accumulate_grad_batches": c.grad_accum_steps,
    }
    if c.parallel != "none":
        trainer["devices"] = c.world_size
        if c.parallel == "ddp":
            trainer["strategy"] = "ddp"
    warnings = [
        f"micro_batch_size {c.micro_batch_size} is not a Trainer setting: give your "
        f"DataLoader batch_size={c.micro_batch_size}.",
        _optimizer_in_code(c, "return it from LightningModule.configure_optimizers()"),
        *_checkpoint_in_code(result, "the Trainer has no per-block activation checkpointing"),
        *_offload(
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
        (*_origin(result, "Lightning Trainer arguments"), usage),
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
    if c.offload_optimizer and c.optimizer != "adamw":
        settings["zero_allow_untested_optimizer"] = True
    wrapped = (*c.checkpoint, *c.offload_activations)
    if wrapped:
        settings["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": bool(c.offload_activations),
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    warnings = [_optimizer_in_code(c, "pass it to deepspeed.initialize(optimizer=...)")]
    if c.parallel != "none":
        warnings += deepspeed_parallel(result, settings)
    if c.offload_optimizer and c.parallel == "none":
        warnings.append(
            "offload_optimizer: with a client optimizer DeepSpeed wants its CPU Adam: pass "
            "deepspeed.ops.adam.DeepSpeedCPUAdam for adamw."
        )
    warnings += _partial_mask(result, "DeepSpeed activation checkpointing")
    if c.offload_activations:
        warnings.append(
            f"offload_activations ({', '.join(c.offload_activations)}): DeepSpeed's "
            "cpu_checkpointing moves the inputs of every checkpointed layer to the host and "
            "recomputes them; autotune kept these blocks' activations on the host without "
            "recomputing."
        )
    notes = [*_origin(result, "DeepSpeed config")]
    if wrapped:
        notes.append(
            "activation checkpointing applies to the layers your model runs through "
            f"deepspeed.checkpointing.checkpoint: {', '.join(wrapped)}"
        )
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
        "use_cpu": _on_cpu(result),
        "num_machines": 1,
        "num_processes": 1,
        "machine_rank": 0,
        "debug": False,
    }
    warnings = [
        f"micro_batch_size {c.micro_batch_size} is not an accelerate setting: give your "
        f"DataLoader batch_size={c.micro_batch_size}.",
        _optimizer_in_code(c, "pass it to accelerator.prepare()"),
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
    elif c.checkpoint:
        warnings += _checkpoint_in_code(
            result, "accelerate has no activation checkpointing setting"
        )
    if c.offload_activations:
        warnings.append(_lost_offload_activations(c, "accelerate"))
    usage = "use: accelerate launch --config_file path train.py"
    return Export(
        "accelerate", settings, tuple(warnings), (*_origin(result, "accelerate config"), usage)
    )


def to_torchrun(result: TuneResult) -> Export:
    """The ``torchrun`` command line of a data-parallel result."""
    if result.config.parallel == "none":
        raise ConfigError(
            "this result trains on one process; torchrun is for a result tuned with "
            "world_size (under torchrun, or planned with --world-size)."
        )
    settings, notes = torchrun_command(result)
    return Export("torchrun", settings, (), (*_origin(result, "torchrun command"), *notes))


_EXPORTERS: dict[str, Callable[[TuneResult], Export]] = {
    "hf": to_hf,
    "lightning": to_lightning,
    "deepspeed": to_deepspeed,
    "accelerate": to_accelerate,
    "torchrun": to_torchrun,
}
TARGETS: tuple[str, ...] = tuple(_EXPORTERS)
"""The trainers :func:`export` writes settings for."""


def export(result: TuneResult, target: str) -> Export:
    """The settings of ``result.config`` for ``target`` (one of :data:`TARGETS`).

    Raises:
        ConfigError: ``target`` is unknown.
    """
    if target not in _EXPORTERS:
        raise ConfigError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}.")
    return _EXPORTERS[target](result)


# --- the knobs each target leaves to the user's code -----------------------------------

_HF_OPTIM = {
    "adamw": "adamw_torch",
    "sgd": "sgd",
    "adafactor": "adafactor",
    "adamw8bit": "adamw_bnb_8bit",
}
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
_TORCH_OPTIMIZER = {
    "adamw": "torch.optim.AdamW",
    "sgd": "torch.optim.SGD(momentum=0.9)",
    "adafactor": "torch.optim.Adafactor",
    "adamw8bit": "bitsandbytes.optim.AdamW8bit",
}


def _origin(result: TuneResult, what: str) -> tuple[str, ...]:
    c = result.config
    return (
        f"{what} from autotune: {c.describe()} (effective batch {c.effective_batch_size}"
        + (f" per rank, global {c.global_batch_size})" if c.world_size > 1 else ")"),
        f"tuned for {result.model.class_name} on {result.target.name} ({result.target.device}) "
        f"within {format_bytes(result.budget_bytes)}{' per rank' if c.world_size > 1 else ''}; "
        + (
            f"predicted peak {format_bytes(result.predicted.peak_bytes)}, NOT VERIFIED: "
            + "; ".join(result.unverified)
            if result.unverified
            else f"measured peak {format_bytes(result.measured.peak_bytes)}"
        ),
    )


def _on_cpu(result: TuneResult) -> bool:
    return result.target.device.split(":")[0] == "cpu"


def _partial_mask(result: TuneResult, setting: str) -> list[str]:
    """A warning when only some blocks are checkpointed but ``setting`` means all of them."""
    ckpt, blocks = result.config.checkpoint, result.model.blocks
    if not ckpt or set(ckpt) >= set(blocks):
        return []
    return [
        f"checkpoint: autotune checkpoints {len(ckpt)} of {len(blocks)} blocks "
        f"({', '.join(ckpt)}) but {setting} covers every layer: this uses less memory than "
        "tuned and is slower."
    ]


def _checkpoint_in_code(result: TuneResult, why: str) -> list[str]:
    ckpt = result.config.checkpoint
    if not ckpt:
        return []
    return [
        f"checkpoint: {why}: autotune.apply(model, result) checkpoints exactly "
        f"{', '.join(ckpt)} (or wrap them in torch.utils.checkpoint.checkpoint(block, x, "
        "use_reentrant=False) yourself)."
    ]


def _optimizer_in_code(c: TrainConfig, how: str) -> str:
    build = _TORCH_OPTIMIZER[c.optimizer]
    return f"optimizer {c.optimizer} is not in this file: build {build} and {how}."


def _offload(c: TrainConfig, where: str, instead: str) -> list[str]:
    out = []
    if c.offload_optimizer:
        out.append(f"offload_optimizer: {where} cannot keep the optimizer on the host; {instead}.")
    if c.offload_activations:
        out.append(_lost_offload_activations(c, where))
    return out


def _lost_offload_activations(c: TrainConfig, where: str) -> str:
    return (
        f"offload_activations ({', '.join(c.offload_activations)}): {where} cannot offload "
        "activations to the host; autotune.apply(model, result) offloads exactly these blocks."
    )
