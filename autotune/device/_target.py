"""The target device: what it is, how much memory it has, and the budget on it.

GB in autotune means GiB (2**30 bytes), as ``nvidia-smi`` and torch report memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from autotune._format import GIB
from autotune._spelling import option
from autotune.device._backend import backend_for
from autotune.device._resolve import resolve_device
from autotune.errors import BudgetError, warn
from autotune.result import TargetInfo

__all__ = ["Target", "budget_bytes", "discover", "host_peak_bytes"]


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

    def context_now(self) -> int:
        """The context's bytes as they are now: the CUDA context grows as training steps
        load kernels and cuBLAS workspaces, which :func:`discover` could not see yet."""
        return max(self.context_bytes, backend_for(self.device).context_bytes())

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
    backend = backend_for(device)
    host = _host_available_bytes()
    if device.type == "cpu":
        return Target(device, backend.name(), _host_total_bytes(), host, 0, host)
    if not backend.available():
        raise BudgetError(
            f"device {device} was asked for but CUDA is not available here; pass device='cpu'."
        )
    backend.start()
    return Target(
        device, backend.name(), backend.total(), backend.free(), backend.context_bytes(), host
    )


def budget_bytes(budget_gb: float, target: Target) -> int:
    """Validate a budget in GiB and convert it to bytes.

    Raises:
        BudgetError: the budget is not a positive finite number.
    """
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)):
        raise BudgetError(f"{option('budget_gb')} must be a number of GiB, got {budget_gb!r}.")
    if not math.isfinite(budget_gb) or budget_gb <= 0:
        raise BudgetError(
            f"{option('budget_gb')} must be a positive number of GiB, got {budget_gb!r}; pass "
            f"the device memory the training run may use, e.g. {option('budget_gb=24')}."
        )
    budget = int(budget_gb * GIB)
    if budget > target.total_bytes:
        warn(
            f"budget {budget_gb} GiB exceeds {target.name}'s {target.total_bytes / GIB:.1f} "
            "GiB; configurations are still capped by the device.",
            UserWarning,
        )
    return budget


def _host_total_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def _host_available_bytes() -> int:
    available = _proc_kib("/proc/meminfo", "MemAvailable:")
    return available * 1024 if available is not None else _host_total_bytes()


def host_peak_bytes(*, reset: bool = False) -> int:
    """The most host memory this process has held since the last ``reset`` (Linux:
    ``VmHWM``, which writing 5 to ``/proc/self/clear_refs`` resets to what it holds now;
    elsewhere since it started), in bytes; 0 where unknown."""
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    peak = _proc_kib("/proc/self/status", "VmHWM:")
    if peak is not None:
        return peak * 1024
    try:
        import resource
    except ImportError:  # not Unix
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _proc_kib(path: str, key: str) -> int | None:
    """The kB figure of the line of ``path`` starting with ``key`` (``None``: not there)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
