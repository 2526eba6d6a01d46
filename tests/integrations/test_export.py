"""Exports: each trainer's native settings, built into the real objects where installed."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from autotune.config import OPTIMIZERS, TrainConfig
from autotune.errors import ConfigError
from autotune.integrations._export import (
    TARGETS,
    export,
    to_accelerate,
    to_deepspeed,
    to_hf,
    to_lightning,
)
from autotune.result import Breakdown, Measurement, ModelInfo, TargetInfo, TuneResult

BLOCKS = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
ONE_PROCESS = tuple(t for t in TARGETS if t != "torchrun")  # torchrun: data parallelism only


def result_for(config: TrainConfig, *, device: str = "cpu") -> TuneResult:
    """A hand-made result of a 4-block model with ``config`` as the winner."""
    m = Measurement(peak_bytes=3 * 2**30, step_s=0.5, samples_per_s=64.0)
    return TuneResult(
        config=config,
        predicted=m,
        measured=m,
        budget_bytes=4 * 2**30,
        target=TargetInfo(device, "Test GPU" if device != "cpu" else "Test CPU", 2**36, "2.13"),
        model=ModelInfo("GPT", "0123456789abcdef", 10**8, BLOCKS),
        breakdown=Breakdown(2**30, 2**29, 2**30, 2**29, 0),
    )


def leaves(data: object) -> list[object]:
    """Every scalar in nested dicts and lists."""
    if isinstance(data, dict):
        return [v for value in data.values() for v in leaves(value)]
    if isinstance(data, list):
        return [v for value in data for v in leaves(value)]
    return [data]


def comments(text: str) -> list[str]:
    return [line[2:] for line in text.splitlines() if line.startswith("# ")]


def test_hf_builds_real_training_arguments_from_the_file(tmp_path: Path) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    config = TrainConfig(
        micro_batch_size=8, grad_accum_steps=4, precision="bf16", checkpoint=BLOCKS
    )
    out = to_hf(result_for(config))
    path = tmp_path / "hf.yaml"
    path.write_text(out.text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no key transformers 5 deprecates
        (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))
    assert args.per_device_train_batch_size == 8
    assert args.gradient_accumulation_steps == 4
    assert args.bf16 and not args.fp16
    assert args.optim == "adamw_torch" and args.weight_decay == 0.01
    assert args.use_cpu  # tuned on the CPU
    # Never gradient_checkpointing, which some models reject: the callback applies the mask.
    assert not args.gradient_checkpointing
    (warning,) = out.warnings
    assert "AutotuneCallback" in warning and ", ".join(BLOCKS) in warning


def test_hf_partial_mask_is_left_to_the_callback_with_a_warning_and_a_comment(
    tmp_path: Path,
) -> None:
    from transformers import TrainingArguments

    config = TrainConfig(micro_batch_size=2, checkpoint=("blocks.0", "blocks.1"))
    out = to_hf(result_for(config))
    assert not any("checkpointing" in key for key in out.settings)
    (warning,) = out.warnings
    assert "checkpoint (blocks.0, blocks.1)" in warning and "AutotuneCallback" in warning
    assert f"WARNING: {warning}" in comments(out.text)
    args = TrainingArguments(output_dir=str(tmp_path), **yaml.safe_load(out.text))
    assert not args.gradient_checkpointing


@pytest.mark.parametrize(
    ("optimizer", "optim"),
    [("adamw", "adamw_torch"), ("sgd", "sgd"), ("adafactor", "adafactor"),
     ("adamw8bit", "adamw_bnb_8bit")],
)  # fmt: skip
def test_hf_optimizer_names(tmp_path: Path, optimizer: str, optim: str) -> None:
    from transformers import TrainingArguments

    out = to_hf(result_for(TrainConfig(optimizer=optimizer, precision="fp16")))
    args = TrainingArguments(output_dir=str(tmp_path), **yaml.safe_load(out.text))
    assert args.optim == optim
    assert args.fp16 and not args.bf16 and not args.gradient_checkpointing
    if optimizer == "sgd":  # autotune's SGD has momentum: so does the exported one
        assert args.optim_args == "momentum=0.9"


def test_hf_on_a_gpu_does_not_force_the_cpu() -> None:
    out = to_hf(result_for(TrainConfig(), device="cuda:0"))
    assert "use_cpu" not in out.settings


def test_hf_cannot_offload_and_says_so() -> None:
    config = TrainConfig(offload_optimizer=True, offload_activations=("blocks.3",))
    out = to_hf(result_for(config))
    assert len(out.warnings) == 2
    assert any("offload_optimizer" in w and "deepspeed" in w for w in out.warnings)
    assert any("offload_activations (blocks.3)" in w and "Callback" in w for w in out.warnings)
    assert all(f"WARNING: {w}" in comments(out.text) for w in out.warnings)


def test_lightning_trainer_settings(tmp_path: Path) -> None:
    config = TrainConfig(
        micro_batch_size=4, grad_accum_steps=8, precision="bf16", checkpoint=BLOCKS[:1]
    )
    out = to_lightning(result_for(config, device="cuda:0"))
    trainer = yaml.safe_load(out.text)["trainer"]
    assert trainer == {
        "accelerator": "gpu",
        "devices": 1,
        "precision": "bf16-mixed",
        "accumulate_grad_batches": 8,
    }
    text = "\n".join(out.warnings)
    assert "batch_size=4" in text  # the micro-batch belongs to the DataLoader
    assert "configure_optimizers" in text and "torch.optim.AdamW" in text
    assert "checkpoint: " in text and "blocks.0" in text
    assert all(f"WARNING: {w}" in comments(out.text) for w in out.warnings)
    fp = yaml.safe_load(to_lightning(result_for(TrainConfig(precision="fp16"))).text)
    assert fp["trainer"]["precision"] == "16-mixed"
    assert fp["trainer"]["accelerator"] == "cpu"
    assert to_lightning(result_for(TrainConfig())).settings["trainer"]["precision"] == "32-true"


def test_lightning_builds_a_real_trainer(tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning")
    out = to_lightning(result_for(TrainConfig(grad_accum_steps=2)))
    trainer = lightning.Trainer(
        **out.settings["trainer"], default_root_dir=str(tmp_path), logger=False
    )
    assert trainer.accumulate_grad_batches == 2


def test_deepspeed_config() -> None:
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, precision="fp16")
    out = to_deepspeed(result_for(config))
    data = json.loads(out.text)
    assert any("micro_batch=4" in line for line in data.pop("comment"))
    assert data == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": False},
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 0},
    }
    (warning,) = out.warnings  # the optimizer is the one passed to deepspeed.initialize
    assert "deepspeed.initialize" in warning
    assert f"WARNING: {warning}" in json.loads(out.text)["comment"]


def test_deepspeed_offload_and_activation_checkpointing() -> None:
    config = TrainConfig(
        precision="bf16",
        checkpoint=("blocks.0",),
        offload_activations=("blocks.1",),
        offload_optimizer=True,
        optimizer="sgd",
    )
    out = to_deepspeed(result_for(config))
    data = json.loads(out.text)
    assert data["bf16"] == {"enabled": True}
    assert data["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    assert data["zero_allow_untested_optimizer"] is True
    assert data["activation_checkpointing"]["cpu_checkpointing"] is True
    text = "\n".join(out.warnings)
    assert "1 of 4 blocks" in text  # a partial mask: DeepSpeed's setting is global
    assert "offload_activations (blocks.1)" in text
    assert any("blocks.0, blocks.1" in line for line in data["comment"])  # what to wrap


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("offload", [False, True])
def test_deepspeed_parses_the_config_with_its_own_class(optimizer: str, offload: bool) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    config = TrainConfig(
        micro_batch_size=4,
        grad_accum_steps=2,
        precision="bf16",
        checkpoint=BLOCKS[:2],
        optimizer=optimizer,
        offload_optimizer=offload,
    )
    ds = DeepSpeedConfig(json.loads(to_deepspeed(result_for(config)).text))
    assert ds.train_micro_batch_size_per_gpu == 4
    assert ds.gradient_accumulation_steps == 2
    assert ds.train_batch_size == 8
    assert ds.bfloat16_config.enabled
    assert ds.zero_optimization_stage == (2 if offload else 0)
    if offload:
        assert ds.zero_config.offload_optimizer.device == "cpu"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("target", ONE_PROCESS)
def test_every_optimizer_exports_to_every_target(target: str, optimizer: str) -> None:
    out = export(result_for(TrainConfig(optimizer=optimizer)), target)
    said = json.dumps(out.settings) + "\n".join(out.warnings)
    named = {
        "adamw8bit": "8bit",
        "adafactor": "Adafactor",
        "paged_adamw8bit": "paged_adamw_8bit",
        "adamw_fused": "fused",
    }
    assert optimizer in said or named[optimizer] in said


def test_accelerate_builds_a_real_cluster_config(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    config = TrainConfig(micro_batch_size=16, grad_accum_steps=2, precision="bf16")
    out = to_accelerate(result_for(config))
    path = tmp_path / "accelerate.yaml"
    path.write_text(out.text)
    cluster = ClusterConfig.from_yaml_file(str(path))  # rejects unknown keys
    assert cluster.distributed_type.value == "NO"
    assert cluster.mixed_precision == "bf16"
    assert cluster.use_cpu is True and cluster.num_processes == 1
    text = "\n".join(out.warnings)
    assert "batch_size=16" in text
    assert "Accelerator(gradient_accumulation_steps=2)" in text


def test_accelerate_offload_goes_through_its_deepspeed_plugin(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    config = TrainConfig(grad_accum_steps=4, offload_optimizer=True)
    out = to_accelerate(result_for(config, device="cuda:0"))
    path = tmp_path / "accelerate.yaml"
    path.write_text(out.text)
    cluster = ClusterConfig.from_yaml_file(str(path))
    assert cluster.distributed_type.value == "DEEPSPEED"
    assert cluster.mixed_precision == "no" and cluster.use_cpu is False
    assert cluster.deepspeed_config["offload_optimizer_device"] == "cpu"
    assert cluster.deepspeed_config["gradient_accumulation_steps"] == 4
    assert not any("gradient_accumulation" in w for w in out.warnings)  # carried by the plugin


@pytest.mark.parametrize("target", ONE_PROCESS)
def test_no_knob_is_dropped_silently(target: str) -> None:
    """Every non-default knob is in the settings or in a warning, and warnings are in the file."""
    config = TrainConfig(
        micro_batch_size=3,
        grad_accum_steps=5,
        precision="bf16",
        checkpoint=("blocks.0", "blocks.2"),
        offload_activations=("blocks.3",),
        optimizer="adafactor",
        offload_optimizer=True,
        compile_blocks=("blocks.0", "blocks.1", "blocks.2"),
    )
    out = export(result_for(config), target)
    values, settings = leaves(out.settings), json.dumps(out.settings)
    warnings = "\n".join(out.warnings)
    assert 3 in values or "batch_size=3" in warnings
    assert 5 in values or "gradient_accumulation_steps=5" in warnings
    assert "bf16" in settings
    assert "blocks.0, blocks.2" in warnings  # no target selects blocks: all warn
    assert "offload_activations (blocks.3)" in warnings
    assert "cpu" in settings or "offload_optimizer" in warnings
    assert "adafactor" in settings or "Adafactor" in warnings
    assert "compile_blocks" in warnings  # no target compiles some blocks: all warn
    for warning in out.warnings:
        assert warning in out.text


def test_unknown_target_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="hf, lightning, deepspeed, accelerate"):
        export(result_for(TrainConfig()), "keras")
