"""Data parallelism in one process: the knobs' validation, a clear error without a process
group, and a world size planned (predicted, marked unverified) without having it."""

from __future__ import annotations

import pytest
import torch

import autotune
from autotune.cli._commands import _describe
from autotune.errors import BudgetTooSmallError, ConfigError, DistributedError
from autotune.measure._depth import shallow_copies
from autotune.models import GPT, gpt_batch, tiny_gpt
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import per_rank_batch, world_of


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"parallel": "zero3"}, "parallel must be one of none, ddp, fsdp"),
        ({"parallel": "fsdp", "world_size": 0}, "world_size must be an integer"),
        ({"world_size": 4}, "set parallel to ddp or fsdp"),
        ({"keep_gathered": ("blocks.0",)}, "needs parallel: fsdp"),
        ({"parallel": "fsdp", "world_size": 2, "precision": "fp16"}, r"fp16 \(use bf16\)"),
        ({"parallel": "ddp", "world_size": 2, "offload_activations": ("b",)}, "activation"),
        ({"parallel": "ddp", "world_size": 2, "optimizer": "adamw8bit"}, "adamw8bit"),
    ],
)
def test_bad_parallel_knobs_are_config_errors(knobs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        autotune.TrainConfig(**knobs)  # type: ignore[arg-type]


def test_the_global_batch_counts_every_rank() -> None:
    config = autotune.TrainConfig(
        micro_batch_size=4, grad_accum_steps=2, parallel="fsdp", world_size=3
    )
    assert config.global_batch_size == 24
    assert "fsdpx3" in config.describe()


def test_preparing_without_a_process_group_says_what_to_do(tiny_gpt_model: GPT) -> None:
    config = autotune.TrainConfig(parallel="fsdp", world_size=2)
    before = {k: v.clone() for k, v in tiny_gpt_model.state_dict().items()}
    forward = tiny_gpt_model.blocks[0].forward
    with pytest.raises(DistributedError, match="torchrun"):
        autotune.prepare(tiny_gpt_model, config.replace(checkpoint=("blocks.0",)), device="cpu")
    after = tiny_gpt_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is left alone
    assert tiny_gpt_model.blocks[0].forward == forward  # no checkpoint wrapper either


def test_world_size_and_global_batch_are_checked_before_anything_runs() -> None:
    assert world_of(None) == (1, True)
    assert world_of(1) == (1, True)
    assert world_of(8) == (8, False)  # planned: no group of 8 here
    with pytest.raises(ConfigError, match="world_size must be a positive integer"):
        TuneOptions(world_size=0)  # checked when the options are built
    assert per_rank_batch(64, 4) == 16
    assert per_rank_batch(None, 4) is None
    with pytest.raises(ConfigError, match="multiple of 3"):
        per_rank_batch(64, 3)


def test_a_world_size_not_here_is_planned_and_marked_unverified(
    tiny_gpt_model: GPT, tiny_gpt_batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    single = autotune.estimate(tiny_gpt_model, tiny_gpt_batch, device="cpu")[0]
    budget_gb = single * 0.7 / 2**30  # one process cannot train even micro-batch 1 in this
    with pytest.raises(BudgetTooSmallError):
        autotune.autotune(tiny_gpt_model, tiny_gpt_batch, budget_gb, device="cpu")
    result = autotune.autotune(
        tiny_gpt_model,
        tiny_gpt_batch,
        budget_gb,
        global_batch_size=16,
        world_size=4,
        device="cpu",
    )
    config = result.config
    assert (config.parallel, config.world_size) == ("fsdp", 4)  # sharding is what fits
    assert config.global_batch_size == 16
    assert result.predicted.peak_bytes <= result.budget_bytes
    assert result.trials == () and result.fallbacks == ()  # nothing was run
    assert any("not run with fsdp on 4 ranks" in note for note in result.unverified)
    assert any("collectives" in note for note in result.unverified)
    shown = _describe(result)  # what `autotune show` prints
    assert "per rank, NOT VERIFIED" in shown and "measured" not in shown.split("memory")[0]
    assert "memory      parameters" in shown
    # The plan's per-rank peak is the estimate of that config.
    assert autotune.estimate(tiny_gpt_model, tiny_gpt_batch, config, device="cpu")[0] == (
        result.predicted.peak_bytes
    )


def test_a_planned_result_keeps_its_notes_through_yaml(
    tiny_gpt_model: GPT, tiny_gpt_batch: tuple[torch.Tensor, torch.Tensor], tmp_path
) -> None:
    result = autotune.autotune(
        tiny_gpt_model, tiny_gpt_batch, 0.01, global_batch_size=8, world_size=2, device="cpu"
    )
    loaded = autotune.load(result.save(tmp_path / "plan.yaml"))
    assert loaded.unverified == result.unverified != ()
    assert loaded.config == result.config


def test_a_model_too_large_for_the_device_whole_is_planned_from_shallow_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As if 6 blocks did not fit the device: the plan and the estimate come from copies
    with 3 and 4 blocks, and predict what the whole model's profile predicts."""
    model = tiny_gpt(n_layer=6, n_embd=64, n_head=2, block_size=32, vocab_size=128)
    sample = gpt_batch(model.config, 4)
    config = autotune.TrainConfig(micro_batch_size=4, precision="bf16", parallel="fsdp",
                                  world_size=4, checkpoint=("blocks.2", "blocks.3"))  # fmt: skip
    whole = autotune.estimate(model, sample, config, device="cpu")[0]
    deepened = []
    monkeypatch.setattr("autotune.measure._depth._WHOLE_SHARE", 0.0)
    monkeypatch.setattr(
        "autotune.tuning._profiling.shallow_copies",
        lambda *a: deepened.append(1) or shallow_copies(*a),
    )
    assert autotune.estimate(model, sample, config, device="cpu")[0] == whole
    result = autotune.autotune(
        model, sample, whole * 1.2 / 2**30, global_batch_size=16, world_size=4, device="cpu"
    )
    assert len(deepened) == 2  # the estimate and the plan were both made from copies
    assert result.predicted.peak_bytes <= result.budget_bytes
    assert autotune.estimate(model, sample, result.config, device="cpu")[0] == (
        result.predicted.peak_bytes
    )
