"""A plan's rank traced: the FSDP2 winner of a plan run as one rank of its world size.

A plan's per-rank peak comes from one process's profile, through the planners' model of
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
from autotune._profile_data import Profile
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
    traced_profile: Profile,
    build: Callable[[], nn.Module],
    sample_batch: Any,
    loss_fn: LossFn | None,
    limit: int,
) -> TuneResult:
    """``result`` with its FSDP2 winner's rank traced (``result`` itself otherwise).

    Args:
        result: The plan.
        candidates: Its candidates, fastest predicted first (the first is the winner).
        traced_profile: The profile as traced, before the GPU's translation.
        build: The model's factory (called under tracing).
        sample_batch: A sample batch, or a factory of one (called under tracing).
        loss_fn: The loss (``None``: the model's own).
        limit: The most a rank's peak may be (the budget less the tuner's head-room).
    """
    fsdp = [c for c in candidates if c.config.parallel == "fsdp"][:RANK_TRIES]
    if candidates[0].config.parallel != "fsdp":
        return result
    live = CostModel(dataclasses.replace(traced_profile, context_bytes=0))
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
