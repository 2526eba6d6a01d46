"""The command line, run through ``autotune.cli.main`` (and once as the installed script).

One real tuning run (a 2-block GPT, ~4 s) is shared by the module; estimate and verify run
the model for real on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import autotune
from autotune._format import format_bytes
from autotune.cli import main
from autotune.config import TrainConfig
from autotune.result import PARTS, TuneResult
from autotune.tuning import TuneOptions
from autotune.tuning._estimate import estimate
from autotune.tuning._progress import Progress
from autotune.verify._verifier import Verifier

MODELS = """
import torch
from autotune.models import gpt_batch, tiny_gpt


def model():
    return tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)


def narrower():
    return tiny_gpt(n_layer=2, n_embd=16, n_head=2, block_size=16, vocab_size=64)


def batch():
    return gpt_batch(model().config, 4)


def float_batch():
    return (torch.randn(4, 16), torch.randn(4, 16))


def broken():
    raise RuntimeError("no weights here")


three = 3
"""


@dataclasses.dataclass(frozen=True)
class Tuned:
    """The shared tuning run: the models file, the result file, and what was printed."""

    models: Path
    path: Path
    out: str
    err: str

    def spec(self, attr: str) -> str:
        return f"{self.models}:{attr}"

    def inputs(self, model: str = "model") -> list[str]:
        return [self.spec(model), "--batch", self.spec("batch")]

    def result(self) -> TuneResult:
        return autotune.load(self.path)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    root = tmp_path_factory.mktemp("cli")
    models = root / "models.py"
    models.write_text(MODELS)
    path = root / "tuned.yaml"
    out, err = io.StringIO(), io.StringIO()
    args = ["tune", f"{models}:model", "--batch", f"{models}:batch", "--budget-gb", "0.004"]
    args += ["--global-batch", "8", "--device", "cpu", "--trials", "16", "-o", str(path)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(args) == 0, err.getvalue()
    return Tuned(models, path, out.getvalue(), err.getvalue())


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error_line(err: str, *fragments: str) -> None:
    assert err.startswith("autotune: error: ")
    assert err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


# --- tune and show ---------------------------------------------------------------------


def test_tune_writes_a_result_and_shows_progress(tuned: Tuned) -> None:
    result = tuned.result()
    assert result.config.effective_batch_size == 8
    assert result.measured.peak_bytes <= result.budget_bytes
    assert f"written to {tuned.path}" in tuned.out
    assert result.config.describe() in tuned.out
    # The progress: the pipeline's stages, one line each (stderr is not a terminal here).
    for stage in ("profiling memory", "profiling time", "searching", "verifying", "measured"):
        assert stage in tuned.err


def test_tune_quiet_json(capsys: pytest.CaptureFixture[str], tuned: Tuned, tmp_path: Path) -> None:
    out_path = tmp_path / "small.yaml"
    args = [*tuned.inputs(), "--budget-gb", "0.004", "--global-batch", "2", "--device", "cpu"]
    code, out, err = run(capsys, "tune", *args, "--quiet", "--json", "-o", str(out_path))
    assert code == 0
    # No progress (a machine busy with other work is said even so).
    assert not any(w in err for w in ("profiling", "searching", "verifying", "[")), err
    data = json.loads(out)
    assert data["config"]["effective_batch_size"] == 2
    assert autotune.load(out_path).to_dict() == data


def test_tune_passes_storage_and_study(
    capsys: pytest.CaptureFixture[str], tuned: Tuned, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[TuneOptions] = []

    def fake(model: Any, batch: Any, options: TuneOptions) -> Any:
        seen.append(options)
        return tuned.result()

    monkeypatch.setattr("autotune.tuning.tune", fake)  # the name the command imports
    args = [*tuned.inputs(), "--budget-gb", "2", "--storage", "sqlite:///x.db", "--study", "s1"]
    code, _, _ = run(capsys, "tune", *args, "-q", "-o", os.devnull)
    assert code == 0
    (options,) = seen
    assert (options.storage, options.study_name, options.budget_gb) == ("sqlite:///x.db", "s1", 2.0)
    assert (options.seed, options.world_size, options.sequence_lengths) == (0, None, None)


def test_tune_takes_the_search_space_flags(capsys, tuned: Tuned, tmp_path: Path) -> None:
    out_path = tmp_path / "narrow.yaml"
    args = [*tuned.inputs(), "--budget-gb", "0.004", "--global-batch", "8", "--device", "cpu"]
    args += ["--precisions", "fp32", "--micro-batch-sizes", "2,4", "--no-checkpointing"]
    code, _, err = run(capsys, "tune", *args, "-q", "-o", str(out_path))
    assert code == 0, err
    config = autotune.load(out_path).config
    assert config.precision == "fp32" and config.micro_batch_size in (2, 4)
    assert config.checkpoint == ()
    args = [*tuned.inputs(), "--budget-gb", "0.004", "--device", "cpu", "--trials", "8"]
    code, _, err = run(capsys, "tune", *args, "--blocks", "blocks.1", "-q", "-o", str(out_path))
    assert code == 0, err
    assert set(autotune.load(out_path).config.checkpoint) <= {"blocks.1"}


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--precisions", "fp64"], "--precisions must be a non-empty list"),
        (["--micro-batch-sizes", "8,x"], "--micro-batch-sizes takes integers"),
        (["--micro-batch-sizes", "0"], "--micro-batch-sizes must be positive"),
        (["--optimizers", "lion"], "--optimizers must be"),
        (["--budget-gb", "0.0001"], "raise --budget-gb"),
        (["--sequence-lengths", "8,x"], "--sequence-lengths takes integers"),
        (["--sequence-lengths", "8,16"], "pass --global-batch (samples) or --global-batch-tokens"),
        (["--global-batch-tokens", "100"], "at length"),
    ],
)
def test_errors_name_the_flags_not_the_python_keywords(capsys, tuned: Tuned, flags, words) -> None:
    args = [*tuned.inputs(), "--budget-gb", "0.004", "--device", "cpu", *flags]
    code, _, err = run(capsys, "tune", *args, "-q", "-o", os.devnull)
    assert code == 2
    assert_one_error_line(err, words)
    assert "SearchSpace" not in err and "budget_gb" not in err


def test_every_flag_the_advice_names_is_an_option_a_message_marks() -> None:
    """The command line spells options the library marks, by key: rewording a message
    cannot silently leave a Python keyword in the command line's advice."""
    import ast

    from autotune.cli._types import FLAGS

    marked = set()
    for path in Path(autotune.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "option":
                arg = node.args[0]
                marked.add(arg.value if isinstance(arg, ast.Constant) else arg.id)
    names = {n for n in marked if not n.startswith("_")}  # a constant's name: its value below
    names |= {
        value.value
        for path in Path(autotune.__file__).parent.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") in marked
        and isinstance(value := node.value, ast.Constant)
    }
    assert set(FLAGS) <= names, set(FLAGS) - names
    flags = {w for spelled in FLAGS.values() for w in spelled.split() if w.startswith("--")}
    parser_text = Path(autotune.__file__).with_name("cli").joinpath("_main.py").read_text()
    assert all(f'"{flag}"' in parser_text for flag in flags), flags


def test_show(capsys: pytest.CaptureFixture[str], tuned: Tuned) -> None:
    code, out, _ = run(capsys, "show", str(tuned.path))
    assert code == 0
    result = tuned.result()
    assert out.splitlines()[0] == f"config      {result.config.describe()}"
    for word in ("predicted", "measured", "parameters", "gradients", "optimizer", "activations"):
        assert word in out
    assert out.count("fallback ") == len(result.fallbacks)
    s = result.spent  # where the time went, each part measured
    assert s.profile_s > 0 and s.verification_s > 0
    assert f"profile {s.profile_s:.1f} s, search {s.search_s:.1f} s" in out
    # every verification, with what it measured or why it was rejected
    for r in result.trials:
        assert f"  {r.config.describe()}: " in out
    code, out, _ = run(capsys, "show", str(tuned.path), "--json")
    assert json.loads(out) == result.to_dict()


def test_tune_and_estimate_take_your_optimizer_and_eval_batch(
    capsys, tuned: Tuned, tmp_path, monkeypatch
) -> None:
    out_path = tmp_path / "yours.yaml"
    yours = ["--optimizer", "user_optimizers:sign_momentum"]
    args = [*tuned.inputs(), "--budget-gb", "0.004", "--global-batch", "8", "--device", "cpu"]
    flags = [*yours, "--precisions", "fp32", "--eval-batch", "3", "-q", "-o", str(out_path)]
    code, _, err = run(capsys, "tune", *args, *flags)
    assert code == 0, err
    result = autotune.load(out_path)
    assert result.config.optimizer == "user_optimizers:sign_momentum"
    assert result.config.eval_batch_size == 3  # asked for, and it fits
    again = ["estimate", *tuned.inputs(), "--config", str(out_path), "--json"]
    code, out, err = run(capsys, *again, *yours)
    assert code == 0, err
    assert json.loads(out)["peak_bytes"] == result.predicted.peak_bytes
    monkeypatch.setattr("autotune.train._optimizers._FACTORIES", {})  # a new process
    code, _, err = run(capsys, *again)
    assert code == 2
    assert_one_error_line(err, "pass it: --optimizer MODULE:FACTORY")


def test_a_plan_made_with_your_optimizer_verifies_with_it(capsys, tuned: Tuned, tmp_path) -> None:
    # A plan as `autotune plan --optimizer` writes it: predicted, never run where made.
    result = tuned.result()
    config = result.config.replace(optimizer="user_optimizers:decoupled_adamw")
    plan = dataclasses.replace(result, config=config, measured=None, figures_for="")
    path = plan.save(tmp_path / "plan.yaml")
    yours = ["--optimizer", "user_optimizers:decoupled_adamw"]
    from autotune.cli._plan import check_hint  # what `autotune plan` advises: with the flag

    assert f"verify {path} MODEL --batch BATCH {' '.join(yours)}`" in check_hint(plan, str(path))
    code, out, err = run(capsys, "verify", str(path), *tuned.inputs(), "--device", "cpu", *yours)
    assert code == 0, err
    assert "; not run when planned" in out  # a plan's prediction, never a tuning's measurement


# --- estimate --------------------------------------------------------------------------


def test_estimate_of_a_tuned_config_is_its_prediction(
    capsys: pytest.CaptureFixture[str], tuned: Tuned
) -> None:
    result = tuned.result()
    code, out, _ = run(capsys, "estimate", *tuned.inputs(), "--config", str(tuned.path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["config"] == result.to_dict()["config"]
    assert data["peak_bytes"] == result.predicted.peak_bytes
    assert data["breakdown"] == result.to_dict()["breakdown"]


def test_estimate_knob_flags(capsys: pytest.CaptureFixture[str], tuned: Tuned) -> None:
    args = ["estimate", *tuned.inputs(), "--micro-batch", "8", "--json"]
    _, kept, _ = run(capsys, *args, "--checkpoint", "none")
    _, ckpt, _ = run(capsys, *args, "--checkpoint", "all", "--optimizer", "sgd")
    kept_data, ckpt_data = json.loads(kept), json.loads(ckpt)
    assert ckpt_data["config"]["checkpoint"] == ["blocks.0", "blocks.1"]
    assert ckpt_data["config"]["optimizer"] == "sgd"
    assert ckpt_data["breakdown"]["activations"] < kept_data["breakdown"]["activations"]
    # SGD keeps one state per parameter, AdamW two (and a step count).
    assert ckpt_data["breakdown"]["optimizer"] * 2 == pytest.approx(
        kept_data["breakdown"]["optimizer"], rel=0.01
    )
    _, selective, _ = run(capsys, *args, "--selective-checkpoint", "all")
    selective_data = json.loads(selective)
    assert selective_data["config"]["selective_checkpoint"] == ["blocks.0", "blocks.1"]
    # Keeping the matrix products' outputs: between keeping and checkpointing the blocks.
    acts = selective_data["breakdown"]["activations"]
    assert ckpt_data["breakdown"]["activations"] < acts < kept_data["breakdown"]["activations"]
    code, out, _ = run(capsys, "estimate", *tuned.inputs(), "--checkpoint", "blocks.1")
    assert code == 0
    assert "checkpoint   blocks.1" in out
    lines = out.splitlines()
    at_peak = lines.index("at the peak  what holds memory at that moment")
    assert [line.split()[0] for line in lines[at_peak + 1 : at_peak + 6]] == list(PARTS)
    code, out, _ = run(
        capsys, "estimate", *tuned.inputs(), "--checkpoint", "blocks.0",
        "--selective-checkpoint", "blocks.1",
    )  # fmt: skip
    assert code == 0 and "selective    blocks.1" in out


def test_estimate_says_what_each_part_costs_and_what_grows(
    capsys: pytest.CaptureFixture[str], tuned: Tuned
) -> None:
    args = ["estimate", *tuned.inputs(), "--json", "--micro-batch"]
    eight, nine = (json.loads(run(capsys, *args, n)[1]) for n in ("8", "9"))
    fixed = ("parameters", "gradients", "optimizer", "optimizer_step")
    assert [eight["costs"][k] for k in fixed] == [nine["costs"][k] for k in fixed]
    assert all(eight["costs"][k] > 0 for k in fixed)
    # The gradients cost their full size, whatever of them the peak's snapshot holds.
    assert eight["costs"]["gradients"] >= eight["breakdown"]["gradients"]
    # One more sample adds to the peak what the costs say it adds (the peak is in the
    # micro-batch's forward and backward here): its activations and its input.
    sample = eight["costs"]["activations_per_sample"] + eight["costs"]["batch"] // 8
    assert nine["peak_bytes"] - eight["peak_bytes"] == pytest.approx(sample, rel=0.02)
    assert nine["costs"]["batch"] * 8 == eight["costs"]["batch"] * 9
    _, out, _ = run(capsys, *args[:-2], "--micro-batch", "8")
    assert "grows with the micro-batch" in out and "their sum is more than the peak" in out


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(micro_batch_size=4, grad_accum_steps=2),
        TrainConfig(micro_batch_size=6, precision="bf16", checkpoint=("blocks.0", "blocks.1")),
        TrainConfig(micro_batch_size=4, offload_activations=("blocks.1",), offload_optimizer=True),
        TrainConfig(micro_batch_size=6, precision="bf16", selective_checkpoint=("blocks.1",)),
    ],
)
def test_estimate_predicts_the_measured_peak(config: TrainConfig) -> None:
    from autotune.models import gpt_batch, tiny_gpt

    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    sample = gpt_batch(model.config, 4)
    peak, parts = estimate(model, sample, config, device="cpu")
    assert parts.total == peak
    verifier = Verifier(model, sample, device=torch.device("cpu"), budget_bytes=2**30, loss_fn=None)
    measured, error = verifier.trial(config)
    assert error is None and measured is not None
    if config.offload_optimizer:
        # Gradients leave one by one in the last backward; the model frees a phase's
        # gradients when the next phase starts, so it may over-predict, never under.
        assert measured.peak_bytes <= peak <= 1.05 * measured.peak_bytes
    else:
        assert peak == pytest.approx(measured.peak_bytes, rel=0.02)


def test_estimate_rejects_blocks_the_model_lacks(tuned: Tuned) -> None:
    from autotune.models import gpt_batch, tiny_gpt

    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.raises(autotune.BlockError, match="head"):
        estimate(model, gpt_batch(model.config, 2), TrainConfig(offload_activations=("head",)))
    with pytest.raises(autotune.BlockError, match=r"blocks\.0, blocks\.1"):
        estimate(model, gpt_batch(model.config, 2), TrainConfig(checkpoint=("head",)))


# --- verify ----------------------------------------------------------------------------


def test_verify_fits(capsys: pytest.CaptureFixture[str], tuned: Tuned) -> None:
    code, out, err = run(capsys, "verify", str(tuned.path), *tuned.inputs())
    assert code == 0, err
    assert out.startswith("fits ")
    assert err == ""  # same model, device and torch: no warning
    code, out, _ = run(capsys, "verify", str(tuned.path), *tuned.inputs(), "--json")
    data = json.loads(out)
    assert data["fits"] is True and data["error"] is None
    assert data["measured"]["peak_bytes"] <= data["budget_bytes"]


def test_verify_over_budget_exits_1(
    capsys: pytest.CaptureFixture[str], tuned: Tuned, tmp_path: Path
) -> None:
    data = yaml.safe_load(tuned.path.read_text())
    data["budget_bytes"] = data["measured"]["peak_bytes"] // 2
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(data))
    code, out, _ = run(capsys, "verify", str(small), *tuned.inputs())
    assert code == 1
    assert out.startswith("does not fit") and "out of memory" in out


def test_verify_refuses_another_model(capsys: pytest.CaptureFixture[str], tuned: Tuned) -> None:
    # A narrower model would "fit" another model's config: that verifies nothing.
    code, out, err = run(capsys, "verify", str(tuned.path), *tuned.inputs("narrower"))
    assert code == 2 and "fits" not in out
    assert_one_error_line(err, "is for another model: a GPT of")


def test_verify_bad_input_exits_2(capsys: pytest.CaptureFixture[str], tuned: Tuned) -> None:
    code, _, err = run(capsys, "verify", str(tuned.path), *tuned.inputs("three"))
    assert code == 2
    assert_one_error_line(err, "MODEL must give a torch.nn.Module, got int")
    # The model fails on the batch: an unexpected error, still one line.
    args = [tuned.spec("model"), "--batch", tuned.spec("float_batch")]
    code, _, err = run(capsys, "verify", str(tuned.path), *args)
    assert code == 2
    assert_one_error_line(err, "(run with --traceback for details)")
    with pytest.raises(RuntimeError, match=r"Long|Int"):
        main(["--traceback", "verify", str(tuned.path), *args])
    with pytest.raises(RuntimeError, match=r"Long|Int"):  # the advice followed as written
        main(["verify", str(tuned.path), *args, "--traceback"])


# --- export and report -----------------------------------------------------------------


def test_help_names_every_export_target(capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.integrations._export import TARGETS

    assert main(["--help"]) == 0
    usage = next(line for line in capsys.readouterr().out.splitlines() if "export" in line)
    assert all(target in usage for target in TARGETS), usage


def test_export_to_stdout_and_file(
    capsys: pytest.CaptureFixture[str], tuned: Tuned, tmp_path: Path
) -> None:
    result = tuned.result()
    code, out, err = run(capsys, "export", str(tuned.path), "--to", "hf")
    assert code == 0
    settings = yaml.safe_load(out)
    assert settings["per_device_train_batch_size"] == result.config.micro_batch_size
    assert settings["gradient_accumulation_steps"] == result.config.grad_accum_steps
    target = tmp_path / "trainer.yaml"
    code, out, err = run(capsys, "export", str(tuned.path), "--to", "lightning", "-o", str(target))
    assert code == 0 and out == f"written to {target}\n"
    trainer = yaml.safe_load(target.read_text())["trainer"]
    assert trainer["accumulate_grad_batches"] == result.config.grad_accum_steps
    warnings_ = err.splitlines()  # what the Trainer cannot express, one line each
    assert warnings_ and all(w.startswith("autotune: warning: ") for w in warnings_)
    assert f"batch_size={result.config.micro_batch_size}" in err


def test_report(capsys: pytest.CaptureFixture[str], tuned: Tuned, tmp_path: Path) -> None:
    target = tmp_path / "report.html"
    code, out, _ = run(capsys, "report", str(tuned.path), "-o", str(target))
    assert code == 0 and out == f"written to {target}\n"
    page = target.read_text()
    assert page.count("<svg") == 2 and "http" not in page
    for name in tuned.result().model.blocks:
        assert name in page


# --- errors, help, warnings, the installed script ---------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["show", "missing.yaml"], "cannot read missing.yaml"),
        (["report", "missing.yaml"], "cannot read missing.yaml"),
        (["tune", "nocolon", "--batch", "x:y", "--budget-gb", "1"], "package.module:attr"),
        (["tune", "no_such_module_xyz:m", "--batch", "x:y", "--budget-gb", "1"], "cannot import"),
        (["tune", "{models}:broken", "--batch", "x:y", "--budget-gb", "1"], "no weights here"),
        (["tune", "{models}:nothing", "--batch", "x:y", "--budget-gb", "1"], "no attribute"),
        (["tune", "{models}:model", "--batch", "{models}:batch", "--budget-gb", "-1"], "budget"),
        (["tune", "{models}:model", "--batch", "{models}:batch", "--budget-gb", "1GB!"], "24GiB"),
        # Not taken as --budget-gb: an option is spelled out or refused.
        (["tune", "{models}:model", "--batch", "{models}:batch", "--budget", "1"], "--budget-gb"),
        (
            ["tune", "{models}:m", "--batch", "{models}:b", "--budget-gb", "1", "--trials", "0"],
            "1 to",
        ),
        (
            ["tune", "{models}:m", "--batch", "{models}:b", "--budget-gb", "1", "--trials", "-5"],
            "1 to",
        ),
        (
            ["tune", "{models}:m", "--batch", "{models}:b", "--budget-gb", "1", "--timeout", "nan"],
            "above 0",
        ),
        (
            [
                "tune",
                "{models}:model",
                "--batch",
                "{models}:batch",
                "--budget-gb",
                "1",
                "--device",
                "tpu",
            ],
            "'tpu' is not a torch device",
        ),
        (
            [
                "tune",
                "{models}:m",
                "--batch",
                "{models}:b",
                "--budget-gb",
                "1",
                "--global-batch",
                "1" + "0" * 30,
            ],
            "1 to",
        ),
        (
            ["estimate", "{models}:model", "--batch", "{models}:batch", "--optimizer", "lion"],
            "lion",
        ),
        (["estimate", "{models}:model", "--batch", "{models}:batch", "--checkpoint", "x"], "x"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], tuned: Tuned, args: list[str], fragment: str
) -> None:
    args = [a.replace("{models}", str(tuned.models)) for a in args]
    code, _, err = run(capsys, *args)
    assert code == 2
    assert_one_error_line(err, fragment)


@pytest.mark.parametrize(
    ("text", "gib"),
    [
        ("24", 24.0),
        ("24 GiB", 24.0),
        ("512MiB", 0.5),
        ("24GB", 24e9 / 2**30),  # powers of ten, as the unit says: not 24 GiB
        ("50MB", 50e6 / 2**30),
    ],
)
def test_budgets_mean_exactly_the_unit_they_are_given_in(text: str, gib: float) -> None:
    from autotune.cli._types import gib as parse

    assert parse(text) == pytest.approx(gib, rel=1e-12)


@pytest.mark.parametrize(
    ("kind", "text", "words"),
    [
        ("positive_int", "ten", "a whole number"),
        ("positive_int", "9" * 5000, "a whole number"),
        ("positive_int", "0", "from 1 to"),
        ("seconds", "soon", "expected seconds"),
        ("seconds", "-3", "above 0"),
        ("seconds", "inf", "above 0"),
        ("gib", "24 TB", "24GiB"),
        ("gib", "0.5g", "24GiB"),  # g: giga or gibi? neither is guessed
        ("gib", "0GiB", "above 0"),
        ("gib", "1e999", "above 0"),
    ],
)
def test_bad_values_say_what_was_expected(kind: str, text: str, words: str) -> None:
    import argparse

    from autotune.cli import _types

    with pytest.raises(argparse.ArgumentTypeError, match=words) as caught:
        getattr(_types, kind)(text)
    assert len(str(caught.value)) < 120


def test_a_file_that_cannot_be_written_is_one_line(capsys, tuned: Tuned, tmp_path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "x.yaml"
    code, _, err = run(capsys, "export", str(tuned.path), "--to", "hf", "-o", str(missing))
    assert code == 2
    assert_one_error_line(err, str(missing), "does not exist", "Create it first")


def test_a_reader_that_leaves_early_is_not_an_error(tuned: Tuned) -> None:
    # `autotune show --json tuned.yaml | head -1`: the reader is gone before we write.
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "show", "--json", str(tuned.path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""  # no BrokenPipeError traceback


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tuned: Tuned) -> None:
    code, _, err = run(capsys, "export", str(tuned.path), "--to", "keras")
    assert code == 2 and "invalid choice: 'keras'" in err


@pytest.mark.parametrize("command", ["tune", "show", "estimate", "verify", "export", "report"])
def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: autotune {command}")


def test_warnings_are_one_line(
    capsys: pytest.CaptureFixture[str], tuned: Tuned, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load(path: str) -> TuneResult:
        warnings.warn("tuned with\nan older autotune", autotune.AutotuneWarning, stacklevel=2)
        return autotune.load(path)

    monkeypatch.setattr("autotune.cli._commands.load", load)
    code, out, err = run(capsys, "show", str(tuned.path))
    assert code == 0 and out
    assert err == "autotune: warning: tuned with an older autotune\n"


def test_installed_console_script(tuned: Tuned) -> None:
    script = shutil.which("autotune", path=str(Path(sys.executable).parent)) or shutil.which(
        "autotune"
    )
    if script is None:
        pytest.skip("the autotune console script is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [script, "export", str(tuned.path), "--to", "deepspeed"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["train_micro_batch_size_per_gpu"] == tuned.result().config.micro_batch_size


# --- progress --------------------------------------------------------------------------


def record(msg: str, *args: Any, level: int = logging.INFO, **extra: Any) -> logging.LogRecord:
    return logging.makeLogRecord(
        {"msg": msg, "args": args, "levelno": level, "levelname": logging.getLevelName(level)}
        | extra
    )


def test_progress_bar_on_a_terminal() -> None:
    stream = io.StringIO()
    bar = Progress(stream, tty=True, width=10)
    bar.handle(record("profiling memory on %s (%d blocks)", "CPU", 2))
    bar.started -= 12  # seconds into the run
    assert bar.status().startswith("[##........] 12 s profiling memory")
    bar.handle(record("searching: %d sizes", 4))
    bar.handle(record("trial %d", 5, level=logging.DEBUG, trial=5, n_trials=10))
    assert "searching 5/10" in bar.status()
    bar.handle(record("verifying %s", "micro_batch=8 fp32"))
    bar.handle(record("  measured %.1f samples/s, peak %s", 120.0, "1 MiB"))
    bar.handle(record("verifying %s", "micro_batch=4 fp32"))
    bar.handle(record("  rejected: %s", "out of memory"))
    bar.handle(record("verifying %s", "micro_batch=2 fp32"))
    bar.handle(record("  measured %.1f samples/s, peak %s", 80.0, "1 MiB"))
    assert bar.status().endswith("3 run, 2 fit; best 120.0 samples/s: micro_batch=8 fp32")
    # Re-timing the contenders may put the leader lower: the bar shows the latest timings.
    bar.handle(record("re-timed %s: %.1f samples/s (median of %d)", "micro_batch=8 fp32", 70.0, 3))
    assert bar.status().endswith("best 80.0 samples/s: micro_batch=2 fp32")
    text = stream.getvalue()
    assert "\r\033[K[" in text  # redrawn in place
    assert "  rejected: out of memory\n" in text  # log lines stay above the bar
    assert "trial 5" not in text  # DEBUG records only move the bar
    bar.finish()
    assert stream.getvalue().endswith("\r\033[K")


def test_progress_without_a_terminal_is_plain_lines() -> None:
    stream = io.StringIO()
    bar = Progress(stream, tty=False)
    bar.handle(record("searching: %d sizes", 4))
    bar.handle(record("trial %d", 1, level=logging.DEBUG, trial=1, n_trials=3))
    bar.finish()
    assert stream.getvalue() == "  searching: 4 sizes\n"


def test_estimate_takes_offload_flags(tuned: Tuned, capsys) -> None:
    code, out, _ = run(
        capsys,
        "estimate",
        *tuned.inputs(),
        "--offload-activations",
        "blocks.1",
        "--offload-optimizer",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert data["config"]["offload_activations"] == ["blocks.1"]
    assert data["config"]["offload_optimizer"] is True
    assert data["breakdown"]["optimizer"] == 0


@pytest.mark.parametrize(("given", "kept"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_keeps_torchs_threads_from_spinning(given: str | None, kept: str) -> None:
    """OpenMP reads OMP_WAIT_POLICY when torch loads: the command sets it first (a user's
    own setting stays)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    code = (
        "import os\n"
        "from autotune.cli._main import main\n"
        "main(['show', 'no-such-file.yaml'])\n"
        "print(os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.stdout.split() == [kept], done.stderr


LOSSLESS = """
import pathlib
import torch

with pathlib.Path(__file__).with_suffix(".runs").open("a") as runs:  # a side effect
    runs.write("run\\n")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))


def batch():
    return torch.randn(4, 16)


def loss(output, batch):
    return output.pow(2).mean()
"""


def test_the_loss_advice_works_as_written_and_a_file_runs_once(capsys, tmp_path: Path) -> None:
    file = tmp_path / "lossless.py"
    file.write_text(LOSSLESS)
    spec = ["estimate", f"{file}:model", "--batch", f"{file}:batch", "--micro-batch", "2"]
    code, _, err = run(capsys, *spec)
    assert code == 2
    assert_one_error_line(err, "--loss FILE.py:NAME (NAME(output, batch) a function in a file")
    assert file.with_suffix(".runs").read_text() == "run\n"  # MODEL and --batch: one import
    code, out, err = run(capsys, *spec, "--loss", f"{file}:loss")  # the advice, as written
    assert code == 0, err
    assert "peak" in out


def test_an_unknown_option_points_to_the_commands_own_help(capsys) -> None:
    code, _, err = run(capsys, "show", "x.yaml", "--jsn")
    assert code == 2
    assert_one_error_line(err, "did you mean --json?", "(see autotune show --help)")


def test_a_config_edited_by_hand_is_not_shown_with_another_configs_figures(
    capsys, tuned: Tuned, tmp_path: Path
) -> None:
    result = tuned.result()
    assert not result.edited  # as written
    text = tuned.path.read_text()
    assert f"figures_for: {result.config.digest()}" in text
    was = result.config.precision  # edited by hand, as a user tries another precision
    other = "bf16" if was == "fp32" else "fp32"
    edited = tmp_path / "edited.yaml"
    edited.write_text(text.replace(f"precision: {was}\n", f"precision: {other}\n", 1))
    changed = autotune.load(edited)
    assert changed.config.precision == other and changed.edited
    code, out, _ = run(capsys, "show", str(edited))
    assert code == 0
    assert "peak        not measured for this config: it was edited after tuning" in out
    assert format_bytes(result.measured.peak_bytes) not in out.split("verified")[0]
    code, out, _ = run(capsys, "verify", str(edited), *tuned.inputs())
    assert "predicted and when tuned: none for this config (edited after tuning)" in out
    from autotune.models import tiny_gpt

    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    with pytest.warns(autotune.AutotuneWarning, match="edited after tuning"):
        autotune.prepare(model, changed, device="cpu").close()


def test_a_module_that_is_not_there_is_said_before_torch_loads() -> None:
    code = (
        "import sys\n"
        "from autotune.cli._main import main\n"
        "code = main(['tune', 'nosuchmodule:model', '--batch', 'nosuchmodule:batch',\n"
        "             '--budget-gb', '1', '-o', 'unused.yaml'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "cannot import 'nosuchmodule'" in done.stderr
