"""Planning on the cost model: pure arithmetic over a profile, no device, no training code.

* ``_memory_model``: peak device bytes, the phase timeline replayed for any config.
* ``_time_model``: seconds per step, offload copies included.
* ``_cost``: ``CostModel``, both together, and the exact per-block knapsack (``_knapsack``).
* ``_planner``: ``Planner``, the knobs a search may turn and the cheapest config that fits.
* ``_search``: the Optuna study; ``_candidates``: enumerations (largest fitting micro-batch,
  exhaustive best, fallback candidates); ``_too_small``: the error when nothing fits.

Nothing is re-exported here: importing one module loads only what it needs.
"""
