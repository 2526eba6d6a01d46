"""Seconds a data-parallel step spends in collectives, from the process group's timings.

FSDP2 gathers every unit before its forward, again before its backward unless it stays
gathered (the root stays gathered), and reduce-scatters every unit's gradients, each
micro-batch. DDP all-reduces the gradients once per step (in the last micro-batch).
On CUDA the collectives run on their own streams, beside compute; on the CPU (gloo)
they block it.
"""

from __future__ import annotations

from autotune._profile_data import Profile
from autotune.config import TrainConfig
from autotune.cost._layout import Units

__all__ = ["comm_seconds", "parallel_step_s"]


def comm_seconds(profile: Profile, config: TrainConfig) -> float | None:
    """Collective seconds per optimizer step of one rank; ``None`` when the collectives
    were not measured at this world size (planned in one process)."""
    comm = profile.comm
    if config.parallel == "none":
        return 0.0
    if comm is None or comm.world_size != config.world_size:
        return None
    if config.parallel == "ddp":
        return comm.all_reduce(profile.grad_bytes)
    units = Units.of(profile, config.world_size, config.precision)
    k = len(profile.blocks)
    kept = {i for i, name in enumerate(profile.blocks) if name in config.keep_gathered}
    per_micro = sum(comm.all_gather(g) for g in units.gathered)
    per_micro += sum(comm.all_gather(units.gathered[i]) for i in range(k) if i not in kept)
    per_micro += sum(comm.reduce_scatter(r) for r in units.reduce if r)
    return per_micro * config.grad_accum_steps


def parallel_step_s(compute_s: float, comm_s: float, device_type: str) -> float:
    """A step's seconds from its compute and its collectives: beside each other on CUDA's
    streams, one after the other on the CPU."""
    return max(compute_s, comm_s) if device_type == "cuda" else compute_s + comm_s
