"""Measuring on the target device: what a model costs on it.

* ``_tracker``: the live-bytes tracker (exact live tensor bytes, phase by phase, and the
  CPU budget guard); ``_peak``: peak device memory by each device's definition, and
  ``peak_memory()``, that peak of a user's own loop.
* ``_timeline``: phase-labelled memory timelines of a training step, fitted in batch size.
* ``_profiler``: the single measurements; ``_memory_profile`` and ``_time_profile``
  assemble them into a profile; ``_depth``: a model deeper than the device holds,
  profiled on shallow copies; ``_parameters``: what its parameters weigh.
* ``_collectives``: host<->device copy speeds, and the process group's collectives.
* ``_fake``: tracing on fake tensors, a model of any size profiled without its memory,
  where torch's fake kernels refuse what the CPU runs, and the roofline clock of a GPU
  that is not here;
  ``_rank_trace``: one rank of FSDP2 traced at any world size (a fake group).

The profile's records, the cost model's only input, are :mod:`autotune._profile_data`'s:
below every layer, so that the cost model reads them without the training code.

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.measure._collectives import measure_collectives, measure_transfer
from autotune.measure._depth import deepen, deepen_time, shallow_copies, whole_fits
from autotune.measure._fake import TRACED_ASSUMPTIONS, Roofline, is_traced, traced
from autotune.measure._memory_profile import memory_profile, working_copy
from autotune.measure._peak import measure_peak
from autotune.measure._profiler import Profiler
from autotune.measure._rank_trace import fake_ranks, traced_rank_peak
from autotune.measure._time_profile import fast_precisions, time_profile
from autotune.measure._tracker import state_tensors

__all__ = [
    "TRACED_ASSUMPTIONS",
    "Profiler",
    "Roofline",
    "deepen",
    "deepen_time",
    "fake_ranks",
    "fast_precisions",
    "is_traced",
    "measure_collectives",
    "measure_peak",
    "measure_transfer",
    "memory_profile",
    "shallow_copies",
    "state_tensors",
    "time_profile",
    "traced",
    "traced_rank_peak",
    "whole_fits",
    "working_copy",
]
