"""Device facts: the CUDA context from NVML, with NVML stood in by a small fake (CI has no
GPU driver); the logic is the one discover() runs on a GPU."""

from __future__ import annotations

import pytest
from fake_nvml import FakeNvml, Proc

from autotune.device._backend import context_bytes
from autotune.device._target import discover

GIB = 2**30


def test_the_gpu_is_found_by_uuid_not_by_index() -> None:
    # CUDA_VISIBLE_DEVICES=1: our cuda:0 is NVML's second GPU, where we use 3 GiB.
    nvml = FakeNvml({"GPU-aaa": [Proc(7, 9 * GIB)], "GPU-bbb": [Proc(42, 3 * GIB)]})
    assert context_bytes(nvml, "bbb", 42, 2 * GIB, 20 * GIB) == GIB
    assert nvml.open == 0  # shut down again


def test_in_a_container_the_only_process_on_the_gpu_is_this_one() -> None:
    nvml = FakeNvml({"GPU-aaa": [Proc(1234, 3 * GIB)]})  # the host's PID for our 42
    assert context_bytes(nvml, "aaa", 42, 2 * GIB, 9 * GIB) == GIB


def test_several_processes_none_ours_fall_back_to_the_device_capped() -> None:
    nvml = FakeNvml({"GPU-aaa": [Proc(1234, 3 * GIB), Proc(1235, 5 * GIB)]})
    assert context_bytes(nvml, "aaa", 42, 2 * GIB, 2 * GIB + 500 * 2**20) == 500 * 2**20
    assert context_bytes(nvml, "aaa", 42, 2 * GIB, 9 * GIB) == GIB  # others share the GPU


@pytest.mark.parametrize("nvml", [None, FakeNvml({})])
def test_without_nvml_or_an_unknown_gpu_it_falls_back(nvml: FakeNvml | None) -> None:
    assert context_bytes(nvml, "zzz", 42, GIB, GIB + 300 * 2**20) == 300 * 2**20


def test_the_cpu_has_no_context() -> None:
    target = discover("cpu")
    assert target.context_bytes == 0 and target.total_bytes > 0 and target.name
