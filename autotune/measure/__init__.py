"""Measuring on the target device: what a model costs on it.

* ``_tracker``: the live-bytes tracker (exact live tensor bytes, phase by phase, and the
  CPU budget guard); ``_peak``: peak device memory by each device's definition;
  ``_peak_memory``: ``peak_memory()``, that peak of a user's own loop.
* ``_timeline``: phase-labelled memory timelines of a training step, fitted in batch size.
* ``_profiler``: the single measurements; ``_memory_profile`` and ``_time_profile``
  assemble them into a profile; ``_depth``: a model deeper than the device holds,
  profiled on shallow copies; ``_parameters``: what its parameters weigh.
* ``_transfer``: host<->device copy speeds; ``_collectives``: the process group's.
* ``_fake``: tracing on fake tensors, a model of any size profiled without its memory;
  ``_fake_kernels``: where torch's fake kernels refuse what the CPU runs;
  ``_rank_trace``: one rank of FSDP2 traced at any world size (a fake group).
* ``_profile_data``: the profile's records and their JSON, the planner's only input. It
  imports no training code.

The interface the other layers use is the table below (see :mod:`autotune._interface`);
each name loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface

if TYPE_CHECKING:
    from autotune.measure._collectives import measure_collectives
    from autotune.measure._depth import deepen, deepen_time, shallow_copies, whole_fits
    from autotune.measure._fake import TRACED_ASSUMPTIONS, is_traced, traced
    from autotune.measure._memory_profile import memory_profile, sharded_precisions, working_copy
    from autotune.measure._peak import measure_peak
    from autotune.measure._profile_data import (
        CHECKPOINT,
        KEEP,
        OFFLOAD,
        SELECTIVE,
        Collectives,
        Line,
        Phase,
        Profile,
        profile_from_json,
        profile_to_json,
    )
    from autotune.measure._profiler import Profiler
    from autotune.measure._rank_trace import fake_ranks, traced_rank_peak
    from autotune.measure._roofline import Roofline
    from autotune.measure._time_profile import fast_precisions, time_profile
    from autotune.measure._tracker import state_tensors
    from autotune.measure._transfer import Transfer, measure_transfer

INTERFACE = {
    "CHECKPOINT": "autotune.measure._profile_data",
    "Collectives": "autotune.measure._profile_data",
    "KEEP": "autotune.measure._profile_data",
    "Line": "autotune.measure._profile_data",
    "OFFLOAD": "autotune.measure._profile_data",
    "Phase": "autotune.measure._profile_data",
    "Profile": "autotune.measure._profile_data",
    "Profiler": "autotune.measure._profiler",
    "Roofline": "autotune.measure._roofline",
    "SELECTIVE": "autotune.measure._profile_data",
    "TRACED_ASSUMPTIONS": "autotune.measure._fake",
    "Transfer": "autotune.measure._transfer",
    "deepen": "autotune.measure._depth",
    "deepen_time": "autotune.measure._depth",
    "fake_ranks": "autotune.measure._rank_trace",
    "fast_precisions": "autotune.measure._time_profile",
    "is_traced": "autotune.measure._fake",
    "measure_collectives": "autotune.measure._collectives",
    "measure_peak": "autotune.measure._peak",
    "measure_transfer": "autotune.measure._transfer",
    "memory_profile": "autotune.measure._memory_profile",
    "profile_from_json": "autotune.measure._profile_data",
    "profile_to_json": "autotune.measure._profile_data",
    "shallow_copies": "autotune.measure._depth",
    "sharded_precisions": "autotune.measure._memory_profile",
    "state_tensors": "autotune.measure._tracker",
    "time_profile": "autotune.measure._time_profile",
    "traced": "autotune.measure._fake",
    "traced_rank_peak": "autotune.measure._rank_trace",
    "whole_fits": "autotune.measure._depth",
    "working_copy": "autotune.measure._memory_profile",
}
"""What the other layers may import from here, by the private module that defines it."""

__all__ = [
    "CHECKPOINT",
    "KEEP",
    "OFFLOAD",
    "SELECTIVE",
    "TRACED_ASSUMPTIONS",
    "Collectives",
    "Line",
    "Phase",
    "Profile",
    "Profiler",
    "Roofline",
    "Transfer",
    "deepen",
    "deepen_time",
    "fake_ranks",
    "fast_precisions",
    "is_traced",
    "measure_collectives",
    "measure_peak",
    "measure_transfer",
    "memory_profile",
    "profile_from_json",
    "profile_to_json",
    "shallow_copies",
    "sharded_precisions",
    "state_tensors",
    "time_profile",
    "traced",
    "traced_rank_peak",
    "whole_fits",
    "working_copy",
]

__getattr__, __dir__ = interface(__name__, INTERFACE)
