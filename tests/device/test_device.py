"""Devices in one normal form, decided where they enter (autotune.device._resolve)."""

from __future__ import annotations

import copy

import pytest
import torch

import autotune
from autotune.config import TrainConfig
from autotune.device._resolve import resolve_device
from autotune.errors import ConfigError
from autotune.models import gpt_batch, tiny_gpt


@pytest.mark.parametrize("given", ["cpu", "cpu:0", torch.device("cpu", 0), None])
def test_cpu_in_every_spelling_is_plain_cpu(given: object) -> None:
    if given is None and torch.cuda.is_available():
        pytest.skip("None means CUDA here")
    assert resolve_device(given) == torch.device("cpu")  # type: ignore[arg-type]


def test_cuda_without_an_index_gets_one() -> None:
    resolved = resolve_device("cuda")
    assert resolved.type == "cuda" and resolved.index is not None


def test_a_name_that_is_no_device_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="'gpu' is not a torch device"):
        resolve_device("gpu")


def test_an_offload_config_offloads_whatever_the_device_is_called() -> None:
    model = tiny_gpt()
    config = TrainConfig(micro_batch_size=4, offload_activations=("blocks.1",))
    runner = autotune.prepare(copy.deepcopy(model), config, device="cpu:0")
    runner.step(gpt_batch(model.config, 4))
    assert runner.device == torch.device("cpu")
    assert runner.offloader.moved_bytes["blocks.1"] > 0


def test_other_work_on_the_cores_is_measured_and_named_with_what_to_do(monkeypatch) -> None:
    import subprocess
    import sys

    from autotune.device._load import CpuClock, busy_note

    start = CpuClock.now()
    if start is None:
        pytest.skip("no /proc/stat here")
    # A real process spinning on one core for a second, while this one sleeps.
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    others = CpuClock.now().others_since(start)  # type: ignore[union-attr]
    assert 0.6 < others < 2.5  # about one core (the interpreter's start included)
    monkeypatch.setattr("autotune.device._load.usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    note = busy_note(1.5, None)
    assert note is not None and "1.5 of its 2 cores" in note and "OMP_WAIT_POLICY=PASSIVE" in note
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    note = busy_note(None, 0.04)
    assert note is not None and "scattered by 4%" in note and "OMP_WAIT" not in note
    assert busy_note(0.2, None) is None
