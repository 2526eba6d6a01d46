"""The time half of a profile: the ladder of micro-batch sizes, on a real profiler."""

from __future__ import annotations

import copy

import pytest
import torch

from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.measure._time_profile import time_profile
from autotune.models import gpt_batch, tiny_gpt

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup() -> tuple[Profiler, object]:
    model = tiny_gpt()
    blocks = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    profiler = Profiler(
        copy.deepcopy(model), gpt_batch(model.config, 4), blocks, device=CPU, loss_fn=None
    )
    draft, _ = memory_profile(profiler, ("fp32",), ("adamw",), device_name="cpu", context_bytes=0)
    return profiler, draft


@pytest.mark.parametrize("limit", [16, 4])  # past the speed probe (micro-batch 8), and at it
def test_an_oom_while_timing_ends_the_ladder_with_a_note(setup, monkeypatch, limit: int) -> None:
    profiler, draft = setup
    timed = profiler.fwd_bwd_time

    def fwd_bwd_time(precision: str, b: int, *, checkpoint_all: bool = False) -> float:
        if b >= limit and not checkpoint_all:
            raise torch.OutOfMemoryError("CUDA out of memory. (injected: a shared device)")
        return timed(precision, b, checkpoint_all=checkpoint_all)

    monkeypatch.setattr(profiler, "fwd_bwd_time", fwd_bwd_time)
    profile = time_profile(profiler, draft, {"fp32": 32}, tuple(range(1, 33)), device_name="cpu")
    curve = profile.precisions["fp32"].time
    assert curve is not None and max(curve.batch_sizes) == limit // 2
    assert any(f"out of device memory timing micro-batch {limit};" in n for n in profile.notes)


def test_an_oom_at_the_first_size_is_not_hidden(setup, monkeypatch) -> None:
    profiler, draft = setup

    def fwd_bwd_time(precision: str, b: int, *, checkpoint_all: bool = False) -> float:
        raise torch.OutOfMemoryError("CUDA out of memory. (injected)")

    monkeypatch.setattr(profiler, "fwd_bwd_time", fwd_bwd_time)
    with pytest.raises(torch.OutOfMemoryError):
        time_profile(profiler, draft, {"fp32": 32}, tuple(range(1, 33)), device_name="cpu")
