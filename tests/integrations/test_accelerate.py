"""accelerate's ``Accelerator`` from the tuned result, with ``autotune.apply``, for real."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import MICRO, G, Recorder, fresh, gpt2, runner_replay, samples
from test_transformers import Rows
from torch.utils.data import DataLoader

import autotune
from autotune import TrainConfig, TuneResult
from autotune.errors import ConfigError

pytest.importorskip("accelerate")
from autotune.integrations.accelerate import accelerator

STEPS = 3
LR = 0.05


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; each test builds its Accelerator anew."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_readme_loop_trains_as_tuned_within_the_budget(tuned: TuneResult, peak_of) -> None:
    model = gpt2()
    start = fresh(model)
    recorder = Recorder()
    recorder.attach(model)
    c = tuned.config

    with peak_of(model, tuned.budget_bytes) as reading:
        handle = autotune.apply(model, tuned, lr=LR)
        acc = accelerator(tuned)
        loader = DataLoader(Rows(samples(STEPS * G, seed=1)), batch_size=c.micro_batch_size)
        prepared, optimizer, loader = acc.prepare(model, handle.optimizer, loader)
        for batch in loader:
            with acc.accumulate(prepared):
                acc.backward(prepared(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
        handle.undo()

    assert acc.gradient_accumulation_steps == c.grad_accum_steps
    assert acc.mixed_precision == "no"
    # (a) the peak: under the budget, and what was predicted
    assert reading.peak_bytes <= tuned.budget_bytes
    assert reading.peak_bytes == pytest.approx(tuned.predicted.peak_bytes, rel=0.03)
    # (c) the effective batch is exact
    assert [len(x["input_ids"]) for x in recorder.inputs] == [MICRO] * (G // MICRO) * STEPS
    # (b) the same math as autotune's Runner
    replay, reference = runner_replay(start, tuned, recorder, lr=LR)
    assert torch.equal(torch.stack(recorder.losses), torch.stack(replay.losses))
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_precision_and_offload(tuned: TuneResult) -> None:
    bf16 = dataclasses.replace(tuned, config=TrainConfig(precision="bf16", grad_accum_steps=4))
    acc = accelerator(bf16)
    assert acc.mixed_precision == "bf16" and acc.gradient_accumulation_steps == 4
    offload = dataclasses.replace(tuned, config=TrainConfig(offload_optimizer=True))
    with pytest.raises(ConfigError, match="export --to accelerate"):
        accelerator(offload)
    with pytest.raises(ConfigError, match="takes the TuneResult"):
        accelerator(TrainConfig())  # type: ignore[arg-type]


def test_an_offloaded_optimizer_is_refused_and_the_advice_writes_its_config(
    tuned: TuneResult, tmp_path
) -> None:
    """accelerate keeps an optimizer on the host only through DeepSpeed: the refusal's
    advice, run as written, writes accelerate's config with DeepSpeed's offload."""
    import subprocess
    import sys

    import yaml

    offloaded = dataclasses.replace(tuned, config=tuned.config.replace(offload_optimizer=True))
    with pytest.raises(ConfigError, match="autotune export --to accelerate"):
        accelerator(offloaded)
    path = offloaded.save(tmp_path / "tuned.yaml")
    out = tmp_path / "accelerate.yaml"
    command = [sys.executable, "-m", "autotune.cli", "export", "--to", "accelerate", str(path)]
    done = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    written = yaml.safe_load(out.read_text())
    assert written["distributed_type"] == "DEEPSPEED"
    assert written["deepspeed_config"]["offload_optimizer_device"] == "cpu"
