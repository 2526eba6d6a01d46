"""Planning for a GPU and ranks that are not here, on fake tensors (issue 27)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
import yaml

import autotune
from autotune.cli._commands import _describe
from autotune.cli._main import main
from autotune.device import CONTEXT_BYTES, DEVICES, MATMUL_EFFICIENCY, device_spec
from autotune.measure import Roofline, is_traced, traced, traced_rank_peak
from autotune.models import example_batch, gpt_batch, tiny_gpt
from autotune.train import resize
from autotune.tuning._problem import _MARGIN

BUDGET_GB = 1.0  # the CUDA context alone is 0.9 GB
# One precision, whole-block checkpointing, three sizes: each plan a few seconds of CI.
SPACE = autotune.SearchSpace(
    precisions=("bf16",), selective_checkpointing=False, micro_batch_sizes=(4, 8, 16)
)
SMALL = ["--precisions", "bf16", "--no-selective-checkpointing", "--micro-batch-sizes", "4,8,16"]
BUILT: list[torch.nn.Module] = []


def _counted() -> torch.nn.Module:
    BUILT.append(tiny_gpt())
    return BUILT[-1]


def _plan(**kwargs) -> autotune.TuneResult:
    kwargs.setdefault("device", "RTX4090-24GB")
    kwargs.setdefault("global_batch_size", 16)
    return autotune.plan_ahead(_counted, example_batch, BUDGET_GB, space=SPACE, **kwargs)


@pytest.fixture(scope="module")
def planned() -> autotune.TuneResult:
    BUILT.clear()
    return _plan()


def test_a_plan_is_ranked_within_the_budget_and_says_what_it_assumed(planned) -> None:
    assert planned.config.effective_batch_size == 16
    assert planned.target.name == "RTX4090-24GB"
    speeds = [t.predicted.samples_per_s for t in planned.trials]
    assert len(speeds) > 1 and speeds == sorted(speeds, reverse=True)
    assert planned.measured is None and all(t.measured is None for t in planned.trials)
    assert all(t.predicted.peak_bytes <= planned.budget_bytes for t in planned.trials)
    assert planned.trials[0].config == planned.config
    # On the GPU the context and the allocator's reserve are held beside the tensors.
    assert planned.breakdown.other >= CONTEXT_BYTES
    notes = " ".join(planned.unverified)
    assert "NOT VERIFIED" in notes and "fake tensors" in notes and "RTX4090-24GB" in notes


def test_a_plan_is_written_and_read_back_as_planned(planned, tmp_path: Path) -> None:
    saved = planned.save(tmp_path / "planned.yaml")
    assert yaml.safe_load(saved.read_text())["measured"] is None  # not the prediction again
    back = autotune.load(saved)
    assert back.config == planned.config and back.unverified == planned.unverified
    assert back.measured is None
    shown = _describe(back)  # `autotune show`: ranked on predictions, none run
    assert f"planned     {len(back.trials)} configs, fastest predicted first, none run" in shown
    assert "run for real" not in shown


def test_nothing_is_built_for_real(planned) -> None:
    assert len(BUILT) == 1 and all(is_traced(p) for p in BUILT[0].parameters())


def test_ranks_far_beyond_this_machine_are_planned_per_rank() -> None:
    result = _plan(world_size=64, global_batch_size=64 * 16)
    assert result.config.world_size == 64 and result.config.parallel in ("ddp", "fsdp")
    assert result.config.effective_batch_size == 16  # per rank
    assert any("64 ranks" in note for note in result.unverified)


def _wide() -> torch.nn.Module:  # weights outweigh activations: FSDP2, not DDP, fits
    return tiny_gpt(n_layer=2, n_embd=512, n_head=4, block_size=16, vocab_size=512)


def _wide_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(_wide().config, 4)


def test_an_fsdp_plan_s_rank_is_traced_with_fsdp_itself() -> None:
    """Rank 0 of 8, traced on a process group that sends nothing (exact: see
    tests/parallel/test_per_rank.py), in the place of the one-process model's peak."""
    plan = {"device": "H100-80GB", "world_size": 8, "global_batch_size": 8 * 4, "space": SPACE}
    plain = autotune.plan_ahead(_wide, _wide_batch, 0.95, **plan)
    checked = autotune.plan_ahead(_wide, _wide_batch, 0.95, trace_rank=True, **plan)
    config = checked.config
    assert config == plain.config and config.parallel == "fsdp"
    local = config.effective_batch_size
    rank = traced_rank_peak(_wide, lambda: resize(_wide_batch(), local), config)
    one_process, _ = autotune.estimate(_wide(), _wide_batch(), config, device="cpu")
    # The same translation to the GPU (context, reserve), on the traced live bytes.
    assert checked.predicted.peak_bytes - plain.predicted.peak_bytes == rank - one_process
    assert checked.trials[0].predicted == checked.predicted
    assert checked.predicted.peak_bytes <= checked.budget_bytes
    assert any("rank 0 of 8 traced with FSDP2" in note for note in checked.unverified)


def test_nothing_fits_any_layout_names_the_least_one_needs() -> None:
    """Over several ranks, FSDP2's minimum (shards), not DDP's (the whole model)."""
    plan = {"device": "H100-80GB", "world_size": 8, "global_batch_size": 8 * 4, "space": SPACE}
    with pytest.raises(autotune.BudgetTooSmallError, match="fsdp over 8 ranks") as caught:
        autotune.plan_ahead(_wide, _wide_batch, 0.8, **plan)
    least = caught.value.minimum_bytes
    assert least > 0.8 * 2**30
    # What it names is enough, as the GPU holds it (its allocator's reserve counted), the
    # search's head-room above the least peak included: that budget plans.
    assert least == math.ceil(caught.value.peak_bytes / (1 - _MARGIN["cuda"]))
    result = autotune.plan_ahead(_wide, _wide_batch, (least + 4096) / 2**30, **plan)
    assert caught.value.peak_bytes <= result.predicted.peak_bytes <= result.budget_bytes


def test_the_device_table() -> None:
    assert device_spec("rtx4090-24gb") is DEVICES["RTX4090-24GB"]
    with pytest.raises(autotune.ConfigError, match="H100-80GB"):
        device_spec("H800")
    for spec in DEVICES.values():  # dense peaks: a tensor core's bf16 beats plain fp32
        assert spec.flops["bf16"] > spec.flops["fp32"] > 0 and spec.source


def test_the_roofline_times_a_matmul_by_flops_and_an_add_by_bytes() -> None:
    spec = DEVICES["H100-80GB"]
    n = 4096
    with traced():
        a = torch.empty(n, n, dtype=torch.bfloat16)
        with Roofline(spec) as clock:
            a @ a
        matmul = clock.seconds
        with Roofline(spec) as clock:
            a + a
        add = clock.seconds
    assert matmul == pytest.approx(2 * n**3 / (spec.flops["bf16"] * MATMUL_EFFICIENCY))
    assert add == pytest.approx(3 * n * n * 2 / (spec.bandwidth * 0.8))


def test_cli_plans_a_factory(capsys, tmp_path: Path) -> None:
    out = tmp_path / "planned.yaml"
    fp32 = ["--precisions", "fp32", *SMALL[2:]]  # the CPU's fast precision, for `tune --from`
    code = main(
        ["plan", "autotune.models:tiny_gpt", "--batch", "autotune.models:example_batch",
         "--device", "A100-40GB", "--budget-gb", str(BUDGET_GB), "--global-batch", "16",
         *fp32, "-o", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and out.exists()
    assert "NOT VERIFIED" in printed and "A100-40GB" in printed and "peak per rank" in printed
    assert "other: the batch, buffers and, on a GPU, the CUDA context" in printed
    assert f"on that GPU, `autotune verify {out} MODEL --batch BATCH`" in printed
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "on A100-40GB\n" in shown and "(cpu)" not in shown  # planned here, not run here

    # `tune --from` the plan, here (on the CPU: the code a GPU runs): its budget and
    # global batch, its config verified first, what it predicted beside what was measured.
    plan = autotune.load(out)
    tuned = tmp_path / "tuned.yaml"
    code = main(
        ["tune", "autotune.models:tiny_gpt", "--batch", "autotune.models:example_batch",
         "--from", str(out), "--device", "cpu", *fp32, "-q", "-o", str(tuned)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    result = autotune.load(tuned)
    assert code == 0 and result.budget_bytes == plan.budget_bytes
    assert result.config.global_batch_size == plan.config.global_batch_size
    record = result.trials[0]
    assert record.config == plan.config and record.predicted == plan.predicted
    assert record.measured is not None  # it ran, within the budget
    assert f"the plan    {plan.config.describe()}: peak predicted" in printed


def test_tune_from_a_plan_for_other_ranks_or_batches_says_what_to_do(
    planned, tmp_path: Path
) -> None:
    from autotune.cli._plan import check_hint, describe_plan

    ranks = planned.config.replace(parallel="fsdp", world_size=8)
    path = dataclasses.replace(planned, config=ranks).save(tmp_path / "planned.yaml")
    eight = autotune.load(path)  # what the plan prints and hints: all ranks, torchrun
    assert "samples/s, all 8 ranks" in describe_plan(eight, 1.0)
    hint = f"torchrun --nproc-per-node 8 -m autotune.cli tune MODEL --batch BATCH --from {path}"
    assert hint in check_hint(eight, str(path))
    for world in (None, 8):  # a plan for 8 ranks is verified on 8, not planned again
        with pytest.raises(autotune.ConfigError, match="torchrun --nproc-per-node 8"):
            autotune.autotune(
                tiny_gpt(), example_batch(), 1.0, device="cpu", start_from=path, world_size=world
            )
    with pytest.raises(autotune.ConfigError, match="global batch is 16"):
        autotune.autotune(
            tiny_gpt(), example_batch(), 1.0, device="cpu", start_from=planned, global_batch_size=8
        )
    # A plan for another model (the same block names, wider) is refused before profiling.
    started = time.perf_counter()
    with pytest.raises(autotune.ConfigError, match="the plan is for another model"):
        autotune.autotune(
            tiny_gpt(n_embd=256), example_batch(), 1.0, device="cpu", start_from=planned
        )
    assert time.perf_counter() - started < 2


def test_tune_from_a_file_naming_a_block_the_model_lacks_exits_before_profiling(
    planned, tmp_path: Path, capsys, monkeypatch
) -> None:
    edited = planned.config.replace(checkpoint=("blocks.99",))
    path = dataclasses.replace(planned, config=edited).save(tmp_path / "edited.yaml")

    def profiled(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a run that names a block the model lacks")

    monkeypatch.setattr("autotune.tuning._device_run.profile_model", profiled)
    code = main(
        ["tune", "autotune.models:tiny_gpt", "--batch", "autotune.models:example_batch",
         "--from", str(path), "--device", "cpu", "-q", "-o", str(tmp_path / "t.yaml")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint names 'blocks.99'" in err and "did you mean" in err


def test_cli_plans_a_hugging_face_config(capsys, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "dtype": "bfloat16",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "planned.yaml"
    args = ["plan", "--hf-config", str(path), "--seq-len", "64", "--device", "L4-24GB",
            "--budget-gb", "1", "--global-batch", "16", *SMALL, "-o", str(out),
            "--json"]  # fmt: skip
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["class_name"] == "LlamaForCausalLM"
    # fp32 weights whatever dtype the config was saved in (mixed precision trains them)
    assert result["model"]["n_parameters"] * 4 <= result["breakdown"]["parameters"]


def test_cli_says_what_to_change_when_nothing_fits(capsys) -> None:
    code = main(
        ["plan", "autotune.models:tiny_gpt", "--batch", "autotune.models:example_batch",
         "--budget-gb", "0.0001", *SMALL, "-o", "/dev/null"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 1 and "--world-size" in printed and "LoRA" in printed


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--hf-config", "config.json"], "--seq-len"),
        (["--device", "H800"], "H100-80GB"),
        ([], "MODEL and --batch"),
    ],
)
def test_cli_errors_say_what_to_pass(capsys, flags, words) -> None:
    if "--hf-config" in flags:
        pytest.importorskip("transformers")
    assert main(["plan", *flags]) == 2
    assert words in capsys.readouterr().err


def test_cli_lists_the_devices(capsys) -> None:
    assert main(["plan", "--list-devices"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in DEVICES)


@pytest.mark.parametrize(("precision", "optimizer"), [("bf16", "adamw_fused"), ("fp32", "adamw")])
def test_a_plan_the_profile_cannot_predict_is_verified_and_cannot_crash_the_run(
    planned, monkeypatch, precision: str, optimizer: str
) -> None:
    """The profile drops every precision but fp32 (as one measured slow on a CPU) and
    searches AdamW fused; the plan's config at micro-batch 16 (bf16, or an older plan's
    foreach AdamW) still runs first and outruns every candidate of a space held to
    micro-batch 1, but cannot win: nothing could predict it (it raised a KeyError)."""
    monkeypatch.setattr("autotune.measure._time_profile._SLOW_PRECISION", 1e-9)
    config = autotune.TrainConfig(micro_batch_size=16, precision=precision, optimizer=optimizer)
    plan = dataclasses.replace(planned, config=config)
    space = autotune.SearchSpace(micro_batch_sizes=[1], precisions=["fp32"], checkpointing=False)
    result = autotune.autotune(
        tiny_gpt(), example_batch(), 1.0, device="cpu", start_from=plan, space=space
    )
    assert result.trials[0].config == plan.config and result.trials[0].measured is not None
    assert result.config.precision == "fp32" and result.config.micro_batch_size == 1


LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 128,
}  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "seq_len", "words"),
    [
        ({"num_hidden_layers": 10**6}, 64, "num_hidden_layers is 1000000; it must be a whole"),
        ({"hidden_size": -4}, 64, "hidden_size is -4; it must be a whole number from 1"),
        ({}, 10**9, "--seq-len 1,000,000,000 is past 2,097,152 tokens"),
        ({}, 4096, "--seq-len 4096 is past the model's max_position_embeddings, 128"),
        ({"rms_norm_eps": "x"}, 64, "transformers cannot read"),
        (None, 64, "does not state num_hidden_layers, hidden_size, vocab_size"),
    ],
    ids=["layers", "negative", "huge-seq", "past-positions", "bad-field", "no-sizes"],
)
def test_a_hostile_hugging_face_config_is_refused_fast_naming_the_field(
    tmp_path: Path, edit, seq_len: int, words: str
) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401 (loaded, not timed)

    from autotune.integrations.hf_config import causal_lm

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama"} if edit is None else {**LLAMA, **edit}))
    started = time.perf_counter()
    with pytest.raises(autotune.ConfigError, match=re.escape(words)):
        causal_lm(path, seq_len)
    assert time.perf_counter() - started < 2


def test_a_builder_that_reads_a_value_or_takes_real_memory_is_said_in_planning_terms() -> None:
    import numpy as np

    def reads() -> torch.nn.Module:
        model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
        model.scale = float(model.wte.weight.abs().max().item())  # a value: not on fake
        return model

    with pytest.raises(autotune.ConfigError, match=r"reads no value \(no \.item\(\)"):
        autotune.plan_ahead(reads, example_batch(), 1.0)

    def loads() -> torch.nn.Module:
        weights = np.ones((160, 2**20), dtype=np.float32)  # 640 MiB made for real
        model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
        model.register_buffer("table", torch.from_numpy(weights[:1, :8]).clone())
        return model

    with pytest.warns(
        autotune.AutotuneWarning, match=r"took 0\.\d GiB of this machine's memory"
    ) as warned:
        autotune.plan_ahead(loads, example_batch(), 1.0)
    mine = [w for w in warned if "this machine's memory" in str(w.message)]
    assert mine[0].filename == __file__  # the caller's line, not autotune's
