"""Planning on the cost model: pure arithmetic over a profile, no device, no training code.

* ``_knobs``: ``Knobs``, what the cost model reads of a configuration, as one record.
* ``_memory_model``: peak device bytes, the phase timeline replayed for any config;
  ``_sharded``: per rank under DDP and FSDP2, with ``_layout`` (what a layout makes of
  each unit's bytes).
* ``_time_model``: seconds per step, offload copies included; ``_comm``: collectives'.
* ``_cost``: ``CostModel``, both together, and the exact per-block knapsack (``_knapsack``).
* ``_planner``: ``Planner``, the knobs a search may turn and the cheapest config that fits;
  ``_bounds``: a run's planners, one per layout.
* ``_search``: the Optuna study; ``_candidates``: enumerations (largest fitting micro-batch,
  exhaustive best, fallback candidates); ``_too_small``: the error when nothing fits.

The interface the other layers use is the table below (see :mod:`autotune._interface`);
each name loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface

if TYPE_CHECKING:
    from autotune.plan._bounds import planner_of, planners
    from autotune.plan._candidates import (
        fallback_candidates,
        largest_fitting,
        micro_batch_candidates,
    )
    from autotune.plan._cost import CostModel
    from autotune.plan._planner import Candidate, Planner
    from autotune.plan._search import quiet_optuna, search
    from autotune.plan._too_small import too_small

INTERFACE = {
    "Candidate": "autotune.plan._planner",
    "CostModel": "autotune.plan._cost",
    "Planner": "autotune.plan._planner",
    "fallback_candidates": "autotune.plan._candidates",
    "largest_fitting": "autotune.plan._candidates",
    "micro_batch_candidates": "autotune.plan._candidates",
    "planner_of": "autotune.plan._bounds",
    "planners": "autotune.plan._bounds",
    "quiet_optuna": "autotune.plan._search",
    "search": "autotune.plan._search",
    "too_small": "autotune.plan._too_small",
}
"""What the other layers may import from here, by the private module that defines it."""

__all__ = [
    "Candidate",
    "CostModel",
    "Planner",
    "fallback_candidates",
    "largest_fitting",
    "micro_batch_candidates",
    "planner_of",
    "planners",
    "quiet_optuna",
    "search",
    "too_small",
]

__getattr__, __dir__ = interface(__name__, INTERFACE)
