"""What the driver sees a process hold on the GPU: NVML sampled every millisecond.

Independent of autotune's own measurement (the caching allocator's statistics): it sees
the CUDA context, cuBLAS's workspaces, loaded kernels and whatever else the process took.
Sampling can miss a spike shorter than a millisecond that the allocator gives back at once;
the caching allocator keeps what it reserved, so its peak stays visible.
"""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["NvmlSampler"]


class NvmlSampler:
    """The process's device memory seen by NVML, sampled every millisecond in a thread."""

    def __init__(self, device: torch.device, *, index: int | None = None) -> None:
        """``index``: NVML's index of the GPU, to read it before CUDA starts in this
        process (else it is found by the UUID torch gives ``device``)."""
        self.peak = 0
        self._stop = threading.Event()
        self._handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            if index is not None:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            else:
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid).encode())
            self._nvml = pynvml
        except Exception:  # no NVML here: the column stays empty
            self._handle = None

    def used(self) -> int | None:
        if self._handle is None:
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def __enter__(self) -> NvmlSampler:
        """Sample until the block ends; :attr:`peak` is the block's (NVML's ``used``)."""
        self.peak = 0
        self._stop.clear()
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used() or 0)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._handle is not None:
            self._thread.join()
