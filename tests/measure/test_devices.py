"""Device facts: the CUDA context from NVML, with NVML stood in by a small fake (CI has no
GPU driver); the logic is the one discover() runs on a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from autotune._backend import context_bytes
from autotune.measure._devices import discover

GIB = 2**30


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int


class FakeNvml:
    """GPUs by UUID, each with its processes; it raises as NVML does for an unknown UUID."""

    def __init__(self, gpus: dict[str, list[Proc]]) -> None:
        self.gpus = gpus
        self.open = 0

    def nvmlInit(self) -> None:
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.gpus:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Proc]:
        return self.gpus[handle]


def test_the_gpu_is_found_by_uuid_not_by_index() -> None:
    # CUDA_VISIBLE_DEVICES=1: our cuda:0 is NVML's second GPU, where we use 3 GiB.
    nvml = FakeNvml({"GPU-aaa": [Proc(7, 9 * GIB)], "GPU-bbb": [Proc(42, 3 * GIB)]})
    assert context_bytes(nvml, "bbb", 42, 2 * GIB, 20 * GIB) == GIB
    assert nvml.open == 0  # shut down again


def test_a_container_pid_falls_back_to_the_device_capped() -> None:
    nvml = FakeNvml({"GPU-aaa": [Proc(1234, 3 * GIB)]})  # the host's PID, not ours
    assert context_bytes(nvml, "aaa", 42, 2 * GIB, 2 * GIB + 500 * 2**20) == 500 * 2**20
    assert context_bytes(nvml, "aaa", 42, 2 * GIB, 9 * GIB) == GIB  # others share the GPU


@pytest.mark.parametrize("nvml", [None, FakeNvml({})])
def test_without_nvml_or_an_unknown_gpu_it_falls_back(nvml: FakeNvml | None) -> None:
    assert context_bytes(nvml, "zzz", 42, GIB, GIB + 300 * 2**20) == 300 * 2**20


def test_the_cpu_has_no_context() -> None:
    target = discover("cpu")
    assert target.context_bytes == 0 and target.total_bytes > 0 and target.name
