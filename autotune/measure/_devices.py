"""The target device: what it is, how much memory it has, how fast it copies to and from
the host, and the budget on it.

GB in autotune means GiB (2**30 bytes), as ``nvidia-smi`` and torch report memory.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from autotune._backend import backend_for
from autotune._device import resolve_device
from autotune._format import GIB
from autotune.errors import BudgetError
from autotune.result import TargetInfo

__all__ = ["Target", "Transfer", "budget_bytes", "discover", "measure_transfer"]


@dataclass(frozen=True)
class Target:
    """Facts about the device tuning runs on.

    Attributes:
        device: The torch device.
        name: GPU model name, or the CPU's.
        total_bytes: Device memory (host RAM for the CPU).
        free_bytes: Device memory free now.
        context_bytes: Memory the CUDA context holds (0 on CPU).
        host_available_bytes: Host RAM available now.
    """

    device: torch.device
    name: str
    total_bytes: int
    free_bytes: int
    context_bytes: int
    host_available_bytes: int

    def info(self) -> TargetInfo:
        """The plain facts recorded in a :class:`~autotune.config.TuneResult`."""
        return TargetInfo(
            str(self.device),
            self.name,
            self.total_bytes,
            str(torch.__version__),
            context_bytes=self.context_bytes,
        )


def discover(device: torch.device | str | None = None) -> Target:
    """Describe ``device`` (default: the current CUDA device if any, else the CPU)."""
    device = resolve_device(device)
    if device.type not in ("cuda", "cpu"):
        raise BudgetError(f"device {device} is not supported; use 'cuda' or 'cpu'.")
    ops = backend_for(device)
    host = _host_available_bytes()
    if device.type == "cpu":
        return Target(device, ops.name(), _host_total_bytes(), host, 0, host)
    if not ops.available():
        raise BudgetError(
            f"device {device} was asked for but CUDA is not available here; pass device='cpu'."
        )
    ops.start()
    return Target(device, ops.name(), ops.total(), ops.free(), ops.context_bytes(), host)


@dataclass(frozen=True)
class Transfer:
    """Host<->device copy speeds measured on the target, and the host memory offload may use.

    Attributes:
        d2h_bytes_per_s: Device to pinned host memory.
        h2d_bytes_per_s: Pinned host memory to device.
        host_limit_bytes: Host bytes offload may plan to hold (a share of what is free).
        rounds_host: Each host buffer takes a power of two (torch's pinned allocator).
    """

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_limit_bytes: int
    rounds_host: bool = False


_PROBE_BYTES = 256 * 2**20
_HOST_SHARE = 0.8
"""Offload plans at most this share of the host memory free at tuning time (pinned memory
cannot be swapped out; the rest is left to the data loader and the system)."""


def measure_transfer(target: Target, *, nbytes: int = _PROBE_BYTES) -> Transfer:
    """Time copies between pinned host memory and the device, in both directions.

    On CPU the host is the device: the "transfer" is a memory copy, timed the same way.
    Each direction is the median of three copies after a warm-up copy.
    """
    device = target.device
    ops = backend_for(device)
    n = nbytes // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=ops.pins)
    dev = torch.empty(n, dtype=torch.float32, device=device)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for i in range(4):
            ops.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=ops.pins)
            ops.synchronize()
            if i:  # the first copy warms up
                times.append(time.perf_counter() - start)
        return nbytes / max(statistics.median(times), 1e-9)

    d2h, h2d = timed(host, dev), timed(dev, host)
    del host, dev
    limit = int(target.host_available_bytes * _HOST_SHARE)
    return Transfer(d2h, h2d, limit, rounds_host=ops.rounds_host)


def budget_bytes(budget_gb: float, target: Target) -> int:
    """Validate a budget in GiB and convert it to bytes.

    Raises:
        BudgetError: the budget is not a positive finite number.
    """
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)):
        raise BudgetError(f"budget_gb must be a number of GiB, got {budget_gb!r}.")
    if not math.isfinite(budget_gb) or budget_gb <= 0:
        raise BudgetError(
            f"budget_gb must be a positive number of GiB, got {budget_gb!r}; pass the device "
            "memory the training run may use, e.g. budget_gb=24."
        )
    budget = int(budget_gb * GIB)
    if budget > target.total_bytes:
        warnings.warn(
            f"budget {budget_gb} GiB exceeds {target.name}'s {target.total_bytes / GIB:.1f} "
            "GiB; configurations are still capped by the device.",
            stacklevel=3,
        )
    return budget


def _host_total_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _host_total_bytes()
