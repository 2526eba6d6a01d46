"""Exports of data-parallel results: the torchrun command, accelerate's FSDP2 and DDP, and
DeepSpeed's ZeRO-3, each parsed by the tool's own classes where installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_export import BLOCKS, result_for

from autotune.config import TrainConfig
from autotune.errors import AutotuneWarning, ConfigError
from autotune.integrations._export import export, to_accelerate, to_deepspeed, to_torchrun

FSDP = TrainConfig(
    micro_batch_size=4,
    grad_accum_steps=2,
    precision="bf16",
    parallel="fsdp",
    world_size=8,
    checkpoint=BLOCKS[:2],
    keep_gathered=BLOCKS[3:],
)


def test_torchrun_launches_the_tuned_world_size() -> None:
    out = to_torchrun(result_for(FSDP))
    assert out.text.splitlines()[-1] == "torchrun --nproc-per-node 8 train.py"
    assert "global batch 64" in out.text  # 4 x 2 x 8
    assert "autotune.prepare(model, autotune.load('tuned.yaml'))" in out.text
    with pytest.raises(ConfigError, match="one process"):
        to_torchrun(result_for(TrainConfig()))


def test_torchrun_loads_the_file_it_was_exported_from(tmp_path: Path, capsys) -> None:
    from autotune.cli._main import main

    out = export(result_for(FSDP), "torchrun", path="runs/fsdp-8.yaml")
    assert "autotune.load('runs/fsdp-8.yaml')" in out.text and "tuned.yaml" not in out.text
    saved = tmp_path / "fsdp-8.yaml"
    result_for(FSDP).save(saved)
    assert main(["export", str(saved), "--to", "torchrun"]) == 0
    assert f"autotune.load({str(saved)!r})" in capsys.readouterr().out


def test_accelerate_fsdp2_is_a_real_cluster_config(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    result = result_for(FSDP, device="cuda:0")
    result = type(result)(**{**vars(result), "model": _with_classes(result)})
    out = to_accelerate(result)
    path = tmp_path / "accelerate.yaml"
    path.write_text(out.text)
    cluster = ClusterConfig.from_yaml_file(str(path))  # rejects unknown keys
    assert cluster.distributed_type.value == "FSDP"
    assert cluster.num_processes == 8 and cluster.mixed_precision == "bf16"
    fsdp = cluster.fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert fsdp["fsdp_reshard_after_forward"] is True  # one unit kept: none here (less memory)
    warned = "\n".join(out.warnings)
    assert "keep_gathered (blocks.3)" in warned and "less memory than tuned" in warned
    assert "checkpoints 2 of 4 (blocks.0, blocks.1)" in warned
    for warning in out.warnings:
        assert warning in out.text


def test_accelerate_ddp_on_the_cpu(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    config = TrainConfig(micro_batch_size=8, parallel="ddp", world_size=2)
    path = tmp_path / "accelerate.yaml"
    path.write_text(to_accelerate(result_for(config)).text)
    cluster = ClusterConfig.from_yaml_file(str(path))
    assert cluster.distributed_type.value == "MULTI_CPU"
    assert cluster.num_processes == 2


def test_deepspeed_zero3_parses_with_deepspeeds_own_model() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    out = to_deepspeed(result_for(FSDP.replace(precision="fp32", offload_optimizer=True)))
    data = json.loads(out.text)
    zero = DeepSpeedZeroConfig(**data["zero_optimization"])  # rejects unknown keys
    assert zero.stage == 3
    assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device == "cpu"
    assert data["train_batch_size"] == 64
    assert data["train_micro_batch_size_per_gpu"] == 4
    assert any("ZeRO-3 is not FSDP2" in line for line in data["comment"])


@pytest.mark.parametrize("target", ["hf", "lightning", "deepspeed", "accelerate", "torchrun"])
def test_the_ranks_are_never_dropped_silently(target: str) -> None:
    out = export(result_for(FSDP), target)
    said = json.dumps(out.settings) + "\n".join(out.warnings) + out.text
    assert "8" in said and ("fsdp" in said.lower() or "FSDP" in said or "stage" in said)


def test_a_planned_result_says_it_is_not_verified() -> None:
    result = result_for(FSDP)
    planned = type(result)(**{**vars(result), "unverified": ("planned in one process",)})
    for target in ("accelerate", "torchrun"):
        assert "NOT VERIFIED: planned in one process" in export(planned, target).text


def _with_classes(result):  # type: ignore[no-untyped-def]
    info = result.model
    return type(info)(**{**vars(info), "block_classes": ("Block",)})


def test_a_trainer_with_its_own_data_parallelism_takes_the_per_rank_part() -> None:
    from autotune.integrations._one_process import per_process

    ddp = TrainConfig(micro_batch_size=4, grad_accum_steps=2, parallel="ddp", world_size=4)
    local = per_process(result_for(ddp), "Lightning")
    assert (local.parallel, local.world_size) == ("none", 1)
    assert (local.micro_batch_size, local.grad_accum_steps) == (4, 2)
    with pytest.raises(ConfigError, match="FSDP2 over 8 ranks, which Lightning cannot"):
        per_process(result_for(FSDP), "Lightning")


def test_a_trainer_given_a_table_per_length_trains_the_longest_row_and_says_so() -> None:
    import dataclasses

    from autotune.integrations._one_process import per_process
    from autotune.result import LengthRow, Measurement

    m = Measurement(1, 1.0, 1.0)
    short, long = TrainConfig(micro_batch_size=8), TrainConfig(micro_batch_size=2)
    rows = (LengthRow(128, short, m, m), LengthRow(512, long, m, m))
    result = dataclasses.replace(result_for(long), by_length=rows)
    with pytest.warns(AutotuneWarning, match="the longest row's"):
        assert per_process(result, "the Trainer") == long


def test_the_one_process_refusal_s_advice_gives_a_result_torchrun_launches(
    tmp_path: Path, capsys
) -> None:
    """`--to torchrun` of a one-process result says to plan with --world-size: planned so,
    the result exports to the launch of its ranks."""
    from autotune.cli._main import main

    with pytest.raises(ConfigError, match=r"planned with --world-size"):
        to_torchrun(result_for(TrainConfig()))
    planned = tmp_path / "planned.yaml"
    code = main(
        ["plan", "autotune.models:tiny_gpt", "--batch", "autotune.models:example_batch",
         "--device", "A100-40GB", "--budget-gb", "1.0", "--global-batch", "16",
         "--world-size", "2", "--precisions", "bf16", "--no-selective-checkpointing",
         "--micro-batch-sizes", "4,8", "-o", str(planned)]
    )  # fmt: skip
    assert code == 0
    capsys.readouterr()
    assert main(["export", str(planned), "--to", "torchrun"]) == 0
    assert "torchrun --nproc-per-node 2 train.py" in capsys.readouterr().out


def test_the_fsdp2_refusal_s_export_advice_works(tmp_path: Path, capsys) -> None:
    """A trainer with its own data parallelism refuses an FSDP2 result, advising
    `autotune export --to accelerate` (or prepare under torchrun, which the per-rank tests
    run): that command writes accelerate's FSDP2 config of the result."""
    from autotune.cli._main import main
    from autotune.integrations._one_process import per_process

    with pytest.raises(ConfigError, match=r"autotune export --to accelerate"):
        per_process(result_for(FSDP), "Lightning")
    saved = tmp_path / "fsdp-8.yaml"
    result_for(FSDP).save(saved)
    assert main(["export", str(saved), "--to", "accelerate"]) == 0
    printed = capsys.readouterr().out
    assert "distributed_type: FSDP" in printed and "fsdp_version: 2" in printed
    assert "num_processes: 8" in printed
