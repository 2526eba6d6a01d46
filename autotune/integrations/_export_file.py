"""An export: one trainer's settings, what they leave out, the file; and the sentences
every export shares (where a result comes from, the knobs a target leaves to the user's
code)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from autotune._format import format_bytes
from autotune.config import TrainConfig
from autotune.result import TuneResult

__all__ = [
    "HF_OPTIM",
    "LIGHTNING_PRECISION",
    "TORCH_OPTIMIZER",
    "Export",
    "checkpoint_in_code",
    "chunked_in_code",
    "compiled_in_code",
    "lost_offload_activations",
    "offload",
    "on_cpu",
    "optimizer_in_code",
    "origin",
    "partial_mask",
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


HF_OPTIM = {
    "adamw": "adamw_torch",
    "adamw_fused": "adamw_torch_fused",
    "sgd": "sgd",
    "adafactor": "adafactor",
    "adamw8bit": "adamw_bnb_8bit",
    "paged_adamw8bit": "paged_adamw_8bit",
    "paged_adamw": "paged_adamw_32bit",
}
HF_OPTIM_TUNED = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw_fused",
    "sgd": "sgd",
    "adamw_bnb_8bit": "adamw8bit",
    "adamw_8bit": "adamw8bit",
    "paged_adamw_8bit": "paged_adamw8bit",
    "paged_adamw_32bit": "paged_adamw",
}
"""A Hugging Face ``optim`` -> the autotune optimizer with its class and state (its
``adafactor`` is transformers' own, not torch's, so it is not here)."""
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
TORCH_OPTIMIZER = {
    "adamw": "torch.optim.AdamW",
    "adamw_fused": "torch.optim.AdamW(fused=True)",
    "sgd": "torch.optim.SGD(momentum=0.9)",
    "adafactor": "torch.optim.Adafactor",
    "adamw8bit": "bitsandbytes.optim.AdamW8bit",
    "paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit",
    "paged_adamw": "bitsandbytes.optim.PagedAdamW32bit",
}


def origin(result: TuneResult, what: str) -> tuple[str, ...]:
    c = result.config
    return (
        f"{what} from autotune: {c.describe()} (effective batch {c.effective_batch_size}"
        + (f" per rank, global {c.global_batch_size})" if c.world_size > 1 else ")"),
        f"tuned for {result.model.class_name} on {result.target.name} ({result.target.device}) "
        f"within {format_bytes(result.budget_bytes)}{' per rank' if c.world_size > 1 else ''}; "
        + (
            f"measured peak {format_bytes(result.measured.peak_bytes)}"
            if result.measured and not result.unverified
            else f"predicted peak {format_bytes(result.predicted.peak_bytes)}, NOT VERIFIED: "
            + "; ".join(result.unverified)
        ),
    )


def on_cpu(result: TuneResult) -> bool:
    return result.target.device.split(":")[0] == "cpu"


def partial_mask(result: TuneResult, setting: str) -> list[str]:
    """A warning when only some blocks are checkpointed but ``setting`` means all of them."""
    ckpt, blocks = result.config.checkpoint, result.model.blocks
    if not ckpt or set(ckpt) >= set(blocks):
        return []
    return [
        f"checkpoint: autotune checkpoints {len(ckpt)} of {len(blocks)} blocks "
        f"({', '.join(ckpt)}) but {setting} covers every layer: this uses less memory than "
        "tuned and is slower."
    ]


def checkpoint_in_code(result: TuneResult, why: str) -> list[str]:
    """Warnings for the checkpointed blocks a setting cannot name: apply() wraps them."""
    c = result.config
    out = []
    if c.checkpoint:
        out.append(
            f"checkpoint: {why}: autotune.apply(model, result) checkpoints exactly "
            f"{', '.join(c.checkpoint)} (or wrap them in torch.utils.checkpoint.checkpoint("
            "block, x, use_reentrant=False) yourself)."
        )
    if c.selective_checkpoint:
        out.append(
            f"selective_checkpoint: {why}: autotune.apply(model, result) checkpoints "
            f"{', '.join(c.selective_checkpoint)} selectively, their matrix products, "
            "convolutions and attention kept (torch.utils.checkpoint.checkpoint with "
            "context_fn=create_selective_checkpoint_contexts(policy))."
        )
    return out


def chunked_in_code(c: TrainConfig, where: str) -> list[str]:
    """The warning for the chunked loss, which no trainer computes: ``where`` takes the
    whole logits, more than was tuned."""
    if not c.chunked_loss:
        return []
    return [
        f"chunked_loss: {where} computes the loss over the whole logits, which holds more "
        "than tuned; autotune.prepare(model, result) trains with the chunked loss, and "
        "after autotune.apply(model, result) a Hugging Face language model's "
        "model(**batch).loss is the chunked loss while it trains."
    ]


def compiled_in_code(c: TrainConfig, where: str) -> list[str]:
    """The warning for compiled blocks, which no trainer's setting names: ``where``
    compiles the whole model or nothing; and for the model compiled whole where a file
    cannot say it."""
    if c.compile_model:
        return [
            f"compile_model: compile the whole model, shapes static ({where}, with "
            "dynamic=False), the loss inside its forward where the model computes it (a Hugging "
            "Face model given labels); or autotune.apply(model, result), which compiles the "
            "model's forward as tuned."
        ]
    if not c.compile_blocks:
        return []
    return [
        f"compile_blocks ({len(c.compile_blocks)} blocks): {where} compiles the whole model "
        "or nothing, which holds other memory than tuned; autotune.apply(model, result) "
        "compiles exactly these blocks' forwards (regional compilation), as tuned."
    ]


def optimizer_in_code(c: TrainConfig, how: str) -> str:
    build = TORCH_OPTIMIZER.get(c.optimizer, "it with your factory")
    return f"optimizer {c.optimizer} is not in this file: build {build} and {how}."


def offload(c: TrainConfig, where: str, instead: str) -> list[str]:
    out = []
    if c.offload_optimizer:
        out.append(f"offload_optimizer: {where} cannot keep the optimizer on the host; {instead}.")
    if c.offload_activations:
        out.append(lost_offload_activations(c, where))
    return out


def lost_offload_activations(c: TrainConfig, where: str) -> str:
    return (
        f"offload_activations ({', '.join(c.offload_activations)}): {where} cannot offload "
        "activations to the host; autotune.apply(model, result) offloads exactly these blocks."
    )
