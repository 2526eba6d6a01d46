"""NVML stood in by a small fake (CI has no GPU driver): GPUs by UUID and their processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Proc:
    """One process NVML lists on a GPU."""

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
