"""How fast the target copies to and from the host, and the host memory offload may use."""

from __future__ import annotations

import statistics
import time

import torch

from autotune._profile_data import Transfer
from autotune.device import Target, backend_for

__all__ = ["Transfer", "measure_transfer"]


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
    backend = backend_for(device)
    n = nbytes // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=backend.pins)
    dev = torch.empty(n, dtype=torch.float32, device=device)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for i in range(4):
            backend.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=backend.pins)
            backend.synchronize()
            if i:  # the first copy warms up
                times.append(time.perf_counter() - start)
        return nbytes / max(statistics.median(times), 1e-9)

    d2h, h2d = timed(host, dev), timed(dev, host)
    del host, dev
    limit = int(target.host_available_bytes * _HOST_SHARE)
    return Transfer(d2h, h2d, limit, rounds_host=backend.rounds_host)
