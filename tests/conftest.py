"""Shared fixtures: small models and batches that run in milliseconds on a 2-core CPU."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torchvision_ops import declare_torchvision_ops

from autotune._profile_data import Profile
from autotune.config import Timeline
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.models import GPT, gpt_batch, tiny_gpt

declare_torchvision_ops()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run where CUDA is, and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def single_threaded_torch() -> Iterator[None]:
    """One intra-op thread for the whole suite, restored after.

    Tiny models gain nothing from threads, and on a loaded 2-core machine OpenMP's
    spinning threads make a 2 ms training step take over a second.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def tiny_gpt_model() -> GPT:
    """A 2-layer GPT (blocks ``blocks.0``, ``blocks.1``; head tied to ``wte``), seeded."""
    return tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)


@pytest.fixture
def tiny_gpt_batch(tiny_gpt_model: GPT) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``(idx, targets)`` batch of 8 samples for :func:`tiny_gpt_model`."""
    return gpt_batch(tiny_gpt_model.config, 8)


@pytest.fixture(scope="session")
def gpt3_model() -> GPT:
    """A 3-block GPT shared (read-only) by the cost-model and search tests."""
    return tiny_gpt(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)


@pytest.fixture(scope="session")
def gpt3_sample(gpt3_model: GPT) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(gpt3_model.config, 4)


@pytest.fixture(scope="session")
def gpt_profile(gpt3_model: GPT, gpt3_sample: object) -> Profile:
    """A memory profile (no time curves) of :func:`gpt3_model`: fp32/bf16, adamw/sgd,
    with the selectively checkpointed variant."""
    work = copy.deepcopy(gpt3_model)
    blocks = tuple(f"blocks.{i}" for i in range(len(work.blocks)))
    profiler = Profiler(work, gpt3_sample, blocks, device=torch.device("cpu"), loss_fn=None)
    profile, _ = memory_profile(
        profiler,
        (Timeline("fp32"), Timeline("bf16")),
        ("adamw", "sgd"),
        device_name="cpu",
        context_bytes=0,
        selective=True,
    )
    return profile


@pytest.fixture
def simulated_cuda(monkeypatch: pytest.MonkeyPatch):
    """The CPU behaves as a device with a caching allocator (see simulated_cuda.py) for the
    test: the CUDA logic of autotune runs on CPU tensors. Build models inside the test."""
    import functools

    from simulated_cuda import SimulatedAllocator, SimulatedCuda

    from autotune.device import _backend

    allocator = SimulatedAllocator(total=8 * 2**30)
    backend = functools.partial(SimulatedCuda, allocator=allocator)
    monkeypatch.setitem(_backend._BACKENDS, "cpu", backend)
    with allocator:
        yield allocator
