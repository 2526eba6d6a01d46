"""Measuring on the target device: what it is, and what a model costs on it.

* ``_devices``: the target's facts (name, memory, CUDA context, host RAM, copy speeds)
  and the budget in bytes.
* ``_tracker``: the live-bytes tracker (exact live tensor bytes, phase by phase, and the
  CPU budget guard); ``_peak``: peak device memory by each device's definition.
* ``_timeline``: phase-labelled memory timelines of a training step, fitted in batch size.
* ``_profiler``: the single measurements; ``_memory_profile`` and ``_time_profile``
  assemble them into a profile.
* ``_profile_data``: the profile's records and their JSON, the planner's only input. It
  imports no training code.

Nothing is re-exported here: importing one module loads only what it needs.
"""
