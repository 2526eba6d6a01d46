"""The per-block knapsack: exact on small inputs, and still a valid cover when its
frontier is thinned."""

from __future__ import annotations

import itertools
import random

import pytest

from autotune.cost import _cost_model
from autotune.cost._cost_model import min_cost_choice


def options(n: int, seed: int) -> list[list[tuple[float, float]]]:
    rng = random.Random(seed)
    return [
        [
            (0.0, 0.0),
            (rng.uniform(1, 10), rng.uniform(0.1, 1)),
            (rng.uniform(1, 10), rng.uniform(0.1, 1)),
        ]
        for _ in range(n)
    ]


def brute_force(opts: list[list[tuple[float, float]]], need: float) -> float | None:
    best = None
    for pick in itertools.product(*(range(len(o)) for o in opts)):
        if sum(opts[i][v][0] for i, v in enumerate(pick)) >= need:
            cost = sum(opts[i][v][1] for i, v in enumerate(pick))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_a_small_input_gets_the_brute_force_optimum(seed: int) -> None:
    opts = options(8, seed)
    need = 0.6 * sum(max(s for s, _ in o) for o in opts)
    pick = min_cost_choice(opts, need)  # a frontier this small is never thinned
    assert pick is not None
    assert sum(opts[i][v][0] for i, v in enumerate(pick)) >= need  # a valid cover
    best = brute_force(opts, need)
    assert best is not None
    assert sum(opts[i][v][1] for i, v in enumerate(pick)) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_a_thinned_frontier_still_covers_what_is_needed(monkeypatch, seed: int) -> None:
    monkeypatch.setattr(_cost_model, "_FRONTIER", 6)  # thin after a few items, as huge inputs do
    opts = options(8, seed)
    need = 0.6 * sum(max(s for s, _ in o) for o in opts)
    pick = min_cost_choice(opts, need)
    assert pick is not None
    # A valid cover, though not always the cheapest one: thinning drops states.
    assert sum(opts[i][v][0] for i, v in enumerate(pick)) >= need


def test_nothing_covers_more_than_everything() -> None:
    opts = options(4, 0)
    assert min_cost_choice(opts, 1e9) is None
