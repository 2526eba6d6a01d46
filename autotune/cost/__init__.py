"""The cost model and its search: pure arithmetic over a profile, no device, no training code.

* ``_knobs``: ``Knobs``, what the cost model reads of a configuration, as one record.
* ``_memory_model``: peak device bytes, the phase timeline replayed for any config;
  ``_sharded``: per rank under DDP and FSDP2 (the ``Layout``: what a layout makes of
  each unit's bytes), and the collectives' seconds.
* ``_time_model``: seconds per step, offload copies included.
* ``_cost_model``: ``CostModel``, both together, and the exact per-block knapsack.
* ``_chooser``: ``Chooser``, the knobs a search may turn and the cheapest config that fits;
  ``_bounds``: a run's choosers, one per layout.
* ``_search``: the Optuna study; ``_candidates``: enumerations (largest fitting micro-batch,
  exhaustive best, fallback candidates, the error when nothing fits); ``_expert``: the
  expert's recipe, the config to beat.

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.cost._bounds import chooser_of, choosers
from autotune.cost._candidates import (
    fallback_candidates,
    largest_fitting,
    micro_batch_candidates,
    too_small,
)
from autotune.cost._chooser import Candidate, Chooser
from autotune.cost._cost_model import CostModel
from autotune.cost._expert import ExpertRecipe, expert_candidates
from autotune.cost._search import search

__all__ = [
    "Candidate",
    "Chooser",
    "CostModel",
    "ExpertRecipe",
    "chooser_of",
    "choosers",
    "expert_candidates",
    "fallback_candidates",
    "largest_fitting",
    "micro_batch_candidates",
    "search",
    "too_small",
]
