"""Jobs done once: a tuning run's expensive work, shared between processes.

* ``_job_store``: ``JobStore``, the one verb (``once``: this job's result, done here only
  where no one has done it), ``LocalJobs`` (in memory, one run) and the jobs' keys.
* ``_study_store``: ``StudyStore``, the jobs kept in an Optuna storage, to resume a run or
  share it between processes; ``_claims``: who does each job, and whose result counts,
  the storage's database opened with a timeout, and Optuna kept quiet.

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.jobs._claims import quiet_optuna
from autotune.jobs._job_store import (
    PLAIN,
    Codec,
    JobStore,
    LocalJobs,
    Relayed,
    job_id,
    job_key,
)
from autotune.jobs._study_store import StudyStore, resolve_storage

__all__ = [
    "PLAIN",
    "Codec",
    "JobStore",
    "LocalJobs",
    "Relayed",
    "StudyStore",
    "job_id",
    "job_key",
    "quiet_optuna",
    "resolve_storage",
]
