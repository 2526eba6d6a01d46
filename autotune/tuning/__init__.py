"""The runs: a tuning run, a plan and an estimate, each written out top to bottom.

* ``_device_run``: read first. ``tune_on_device``, a run on the device top to bottom:
  problem -> profile -> search -> verify -> result, its jobs done once among processes
  (:mod:`autotune.jobs`); ``_plan_ahead``: ``plan_with``, the same for a GPU and ranks
  that are not here, traced, an FSDP2 plan's rank traced with FSDP2 itself;
  ``_estimate``: ``estimate()``, one config's peak without tuning, and what each part
  costs.
* ``_autotune``: ``autotune()``, and the runs one call makes: one per sequence length
  (``tune_lengths``), each one per attention implementation (``tune_attentions``); a run
  that starts from a plan, its config verified first (``started_from``).
* ``_options``: ``TuneOptions``, what a call asks for besides the model and its batch;
  ``_problem``: those inputs validated, and what follows from them on the target.
* ``_profiling``: the run's profile, memory then time, on the model whole or on shallow
  copies of it where it does not fit the device whole (``ProfiledCopies``).
* ``_data_parallel``: the search, every layout's (``shortlist``), and results planned for
  ranks not here.
* ``_progress``: a run's progress where a person watches (a terminal, a notebook), and
  the seconds each stage took (``Stopwatch``).

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.tuning._autotune import plan_record, tune, with_optimizer
from autotune.tuning._estimate import Estimate, estimate
from autotune.tuning._options import TuneOptions
from autotune.tuning._plan_ahead import plan_with
from autotune.tuning._progress import Progress, showing_progress

__all__ = [
    "Estimate",
    "Progress",
    "TuneOptions",
    "estimate",
    "plan_record",
    "plan_with",
    "showing_progress",
    "tune",
    "with_optimizer",
]
