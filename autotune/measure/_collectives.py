"""The process group's collectives, timed: what FSDP and DDP spend communicating.

Every rank runs the same collectives at two sizes and the slowest rank's time counts
(a step waits for it), so every rank returns the same numbers.

How fast the target copies to and from the host, and the host memory offload may use.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from autotune._profile_data import Collectives, Line, Transfer
from autotune.device import Target, backend_for
from autotune.train import agree_max, collective

__all__ = ["Transfer", "measure_collectives", "measure_transfer"]

_SIZES = (1 << 18, 1 << 22)
"""Bytes per rank of the two measured sizes (256 KiB and 4 MiB of fp32)."""
_REPEATS = 3


def measure_collectives(device: torch.device) -> Collectives:
    """Time all-gather, reduce-scatter and all-reduce on the default process group.

    Raises:
        DistributedError: another rank failed or stopped answering.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    sync = backend_for(device).synchronize
    points: list[list[tuple[int, float]]] = [[], [], []]
    with collective("timing the collectives"):
        for size in _SIZES:
            shard = torch.ones(size // 4, device=device)
            full = torch.empty(shard.numel() * world, device=device)
            # The names of torch 2.13 (older: all_gather_into_tensor, reduce_scatter_tensor).
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            runs: list[Callable[[], object]] = [
                functools.partial(gather, full, shard),
                functools.partial(scatter, shard, full),
                functools.partial(dist.all_reduce, full),
            ]
            for k, run in enumerate(runs):
                points[k].append((size * world, _seconds(run, sync)))
    seconds = agree_max([t for p in points for _, t in p], device)
    lines = []
    for k, p in enumerate(points):
        (b1, _), (b2, _) = p
        t1, t2 = seconds[2 * k], seconds[2 * k + 1]
        line = Line.through(b1, t1, b2, t2)
        lines.append(line if line.slope > 0 else Line(max(t1, t2), 0.0))
    return Collectives(world, *lines)


def _seconds(run: Callable[[], object], sync: Callable[[], None]) -> float:
    run()  # warm-up: connections, buffers
    sync()
    start = time.perf_counter()
    for _ in range(_REPEATS):
        run()
    sync()
    return (time.perf_counter() - start) / _REPEATS


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
