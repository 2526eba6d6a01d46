"""A plan's rank traced: the FSDP2 winner of a plan run as one rank of its world size.

A plan's per-rank peak comes from one process's profile, through the cost model's account of
shards, gathered units and reduce-scatter buffers. Checking it, one rank of the plan is
traced (:func:`autotune.measure.traced_rank_peak`: the model on fake tensors, wrapped by
FSDP2 itself, in a process group of ``world`` ranks that sends nothing), which is what a
real rank holds byte for byte. The plan's peak becomes the traced one plus the same GPU
translation (context, the allocator's reserve); a plan the trace puts over the budget
gives way to the next FSDP2 plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from autotune._format import format_bytes
from autotune._profile_data import PrecisionProfile, Profile
from autotune.cost import Candidate, CostModel
from autotune.measure import traced_rank_peak
from autotune.result import TuneResult
from autotune.train import LossFn

__all__ = ["RANK_TRIES", "rank_checked"]

RANK_TRIES = 3
"""Plans traced at most, fastest first, before the last traced one is kept over budget."""


def rank_checked(
    result: TuneResult,
    candidates: list[Candidate],
    profile: Profile,
    build: Callable[[], nn.Module],
    sample_batch: Any,
    loss_fn: LossFn | None,
    limit: int,
) -> TuneResult:
    """``result`` with its FSDP2 winner's rank traced (``result`` itself otherwise).

    Args:
        result: The plan.
        candidates: Its candidates, fastest predicted first (the first is the winner).
        profile: The plan's profile, as the GPU holds it.
        build: The model's factory (called under tracing).
        sample_batch: A sample batch, or a factory of one (called under tracing).
        loss_fn: The loss (``None``: the model's own).
        limit: The most a rank's peak may be (the budget less the tuner's head-room).
    """
    fsdp = [c for c in candidates if c.config.parallel == "fsdp"][:RANK_TRIES]
    if candidates[0].config.parallel != "fsdp":
        return result
    live = CostModel(_live(profile))
    for candidate in fsdp:
        config = candidate.config
        traced = traced_rank_peak(build, sample_batch, config, loss_fn=loss_fn)
        predicted = candidate.prediction.measurement
        expected, _ = live.memory(config)
        peak = traced + predicted.peak_bytes - expected  # the same translation to the GPU
        if peak <= limit or candidate is fsdp[-1]:
            break
    note = (
        f"rank 0 of {config.world_size} traced with FSDP2 itself (fake tensors, a process "
        f"group that sends nothing): {format_bytes(traced)} live at its peak where the "
        f"one-process plan said {format_bytes(expected)} ({(traced - expected) / expected:+.2%}); "
        "the peak per rank is the traced one, with the GPU's context and reserve"
    )
    if peak > limit:
        note += f"; {format_bytes(peak - limit)} above the budget less its head-room, as traced"
    return dataclasses.replace(
        result,
        config=config,
        predicted=dataclasses.replace(predicted, peak_bytes=peak),
        breakdown=candidate.prediction.breakdown,
        unverified=(*result.unverified, note),
    )


def _live(profile: Profile) -> Profile:
    """``profile`` as traced, before the GPU's translation: live bytes only, with no
    context, allocator reserve or links (what a traced rank counts)."""

    def unreserved(pp: PrecisionProfile) -> PrecisionProfile:
        return dataclasses.replace(pp, reserve=())

    return dataclasses.replace(
        profile,
        device_type="cpu",
        host_is_device=True,
        context_bytes=0,
        precisions={p: unreserved(pp) for p, pp in profile.precisions.items()},
        sharded={p: unreserved(pp) for p, pp in profile.sharded.items()},
        comm=None,
    )
