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
