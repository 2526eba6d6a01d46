"""The process group's collectives, timed: what FSDP and DDP spend communicating.

Every rank runs the same collectives at two sizes and the slowest rank's time counts
(a step waits for it), so every rank returns the same numbers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from autotune._profile_data import Collectives, Line
from autotune.device import backend_for
from autotune.train import agree_max, collective

__all__ = ["measure_collectives"]

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
