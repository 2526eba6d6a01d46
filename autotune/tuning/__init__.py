"""The orchestration of a tuning run: the pipeline's stages called in order.

* ``_autotune``: ``autotune()``, and the runs one call makes: one per sequence length
  (``_lengths``), each one per attention implementation (``_attention``), each one run
  (``_once``: profile, planners, search, verification, result).
* ``_options``: ``TuneOptions``, what a call asks for besides the model and its batch;
  ``_problem``: those inputs validated, and what follows from them on the target.
* ``_profiling``: the run's profile, memory then time; ``_pieces``: the model whole, or
  shallow copies of it where it does not fit the device whole.
* ``_study``: a run kept in a study, each expensive job done once among processes;
  ``_data_parallel``: searching every layout, and results planned for ranks not here.
* ``_estimate``: ``estimate()``, one config's peak without tuning, and what each part costs.
* ``_progress``: a run's progress where a person watches (a terminal, a notebook).
* ``_ahead``: ``plan_ahead()``, planning for a GPU and ranks that are not here, traced;
  ``_rank_check``: an FSDP2 plan's rank traced with FSDP2 itself; ``_start``: a run
  that starts from a plan, its config verified first.

The interface the other layers use is the table below (see :mod:`autotune._interface`);
each name loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface

if TYPE_CHECKING:
    from autotune.tuning._ahead import plan_with
    from autotune.tuning._autotune import tune, with_optimizer
    from autotune.tuning._estimate import Estimate, estimate
    from autotune.tuning._options import TuneOptions
    from autotune.tuning._progress import Progress, progress
    from autotune.tuning._start import plan_record

INTERFACE = {
    "Estimate": "autotune.tuning._estimate",
    "Progress": "autotune.tuning._progress",
    "TuneOptions": "autotune.tuning._options",
    "plan_with": "autotune.tuning._ahead",
    "plan_record": "autotune.tuning._start",
    "progress": "autotune.tuning._progress",
    "estimate": "autotune.tuning._estimate",
    "tune": "autotune.tuning._autotune",
    "with_optimizer": "autotune.tuning._autotune",
}
"""What the other layers may import from here, by the private module that defines it."""

__all__ = [
    "Estimate",
    "Progress",
    "TuneOptions",
    "estimate",
    "plan_record",
    "plan_with",
    "progress",
    "tune",
    "with_optimizer",
]

__getattr__, __dir__ = interface(__name__, INTERFACE)
