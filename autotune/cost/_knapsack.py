"""Exact multiple-choice knapsack: one choice per block, least added time, enough bytes saved.

Used by :meth:`autotune.cost._cost_model.CostModel.plan` to choose, per block, between keeping,
checkpointing and offloading.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["min_cost_choice", "min_cost_cover"]

Choices = tuple[int, ...]


def min_cost_choice(
    options: Sequence[Sequence[tuple[float, float]]], need: float
) -> Choices | None:
    """One choice per item, least total cost, savings reaching ``need``: exact knapsack.

    ``options[i][v]`` is (savings, cost) of choice ``v`` of item ``i``; choice 0 is "do
    nothing" (0, 0). Dynamic programming over the Pareto frontier of (savings, cost),
    savings capped at ``need`` (any cover is as good as another). Identical two-choice
    items, the usual transformer stack without offload, reduce to "the first k". Past
    ``_FRONTIER`` states the frontier is thinned to the cheapest state per savings
    bucket, which keeps covers valid.
    """
    n = len(options)
    if sum(max(max(s for s, _ in o), 0.0) for o in options) < need:
        return None
    if n and all(len(o) == 2 for o in options):
        gains = [max(o[1][0], 0.0) for o in options]
        costs = [o[1][1] for o in options]
        if max(gains) - min(gains) <= 1e-9 * max(gains) and max(costs) - min(costs) <= 1e-12:
            k = min(n, math.ceil(need / gains[0])) if gains[0] > 0 else n
            return tuple(int(i < k) for i in range(n))
    frontier: list[tuple[float, float, int]] = [(0.0, 0.0, 0)]  # (saved, cost, choices)
    for i, choices in enumerate(options):
        grown = list(frontier)
        for v, (gain, cost) in enumerate(choices):
            if v and gain > 0:
                grown += [
                    (min(s + gain, need), c + cost, bits | v << 2 * i) for s, c, bits in frontier
                ]
        frontier = _pareto(grown, need)
    _, _, bits = min((e for e in frontier if e[0] >= need), key=lambda e: e[1])
    return tuple(bits >> 2 * i & 3 for i in range(n))


def min_cost_cover(savings: Sequence[float], costs: Sequence[float], need: float) -> Choices | None:
    """Least-cost subset of items whose savings reach ``need`` (two choices per item)."""
    return min_cost_choice(
        [[(0.0, 0.0), (s, c)] for s, c in zip(savings, costs, strict=True)], need
    )


_FRONTIER = 4096


def _pareto(states: list[tuple[float, float, int]], need: float) -> list[tuple[float, float, int]]:
    """Keep the states no other state beats on both savings (higher) and cost (lower)."""
    states.sort(key=lambda e: (-e[0], e[1]))
    kept: list[tuple[float, float, int]] = []
    for state in states:
        if not kept or state[1] < kept[-1][1]:
            kept.append(state)
    if len(kept) > _FRONTIER:
        buckets: dict[int, tuple[float, float, int]] = {}
        for state in kept:
            # Round savings down into a bucket: a state only ever claims less than it saves.
            key = int(state[0] / need * _FRONTIER)
            if key not in buckets or state[1] < buckets[key][1]:
                buckets[key] = state
        kept = sorted(buckets.values(), key=lambda e: -e[0])
    return kept
