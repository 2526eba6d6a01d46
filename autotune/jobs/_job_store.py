"""``JobStore``: a tuning run's expensive jobs, each done once.

A job (profiling, searching one layout, verifying one config, re-timing the contenders)
is named by a short key and done through :meth:`JobStore.once`: the first time, ``do()``
runs; after that, its result is read. :class:`LocalJobs` keeps the results in memory for
one run in one process (no storage given); :class:`~autotune.jobs._study_store.StudyStore`
keeps them in an Optuna storage, where several processes, or a run resumed later, share
them; :class:`Relayed` has one process of a group do each job for all of them (rank 0).
The stages of a run call ``once`` the same way with any of them, so a shared run
decides exactly as a lone one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

from autotune._plain_data import to_plain
from autotune.config import TrainConfig

__all__ = ["PLAIN", "Codec", "JobStore", "LocalJobs", "Relayed", "job_id", "job_key"]

T = TypeVar("T")


class Codec(NamedTuple):
    """How a job's result is written to a storage and read back (JSON-able data)."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


PLAIN = Codec(lambda x: x, lambda x: x)
"""A result that is JSON-able as it is."""


class JobStore(Protocol):
    """Where a run's jobs are done once, and their results kept."""

    @property
    def storage(self) -> Any:
        """The Optuna storage the search's trials go to (``None``: in memory)."""
        ...

    @property
    def name(self) -> str | None:
        """The study those trials are kept in (``None``: a study of their own)."""
        ...

    def once(self, job: str, do: Callable[[], T], what: str, codec: Codec = PLAIN) -> T:
        """``job``'s result: done here by ``do()`` where no one has done it, else read.

        Args:
            job: Its key (:func:`job_key`).
            do: Does the job.
            what: The job in words, for the message that says what a run waits for.
            codec: How the result is kept where it is kept as data.
        """
        ...


class LocalJobs:
    """A run's jobs in this process, their results held in memory for the run."""

    storage: Any = None
    name: str | None = None

    def __init__(self) -> None:
        self._done: dict[str, Any] = {}

    def once(self, job: str, do: Callable[[], T], what: str, codec: Codec = PLAIN) -> T:
        if job not in self._done:
            self._done[job] = do()
        result: T = self._done[job]
        return result


class Relayed:
    """``jobs`` whose jobs one process of a group does and relays to the others.

    Args:
        jobs: Where the jobs are done once.
        relay: Runs a function in one process and returns its result in every process
            (:func:`autotune.train.rank_zero`: rank 0 of the process group, and every
            process raises the error it raised).
    """

    def __init__(self, jobs: JobStore, relay: Callable[[Callable[[], Any]], Any]) -> None:
        self.jobs, self.relay = jobs, relay

    @property
    def storage(self) -> Any:
        return self.jobs.storage

    @property
    def name(self) -> str | None:
        return self.jobs.name

    def once(self, job: str, do: Callable[[], T], what: str, codec: Codec = PLAIN) -> T:
        result: T = self.relay(lambda: self.jobs.once(job, do, what, codec))
        return result


def job_id(*parts: str) -> str:
    """A short fixed-length name for a job (keys and names must not grow with the model)."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:20]


def job_key(kind: str, *configs: TrainConfig) -> str:
    """The job of ``kind`` over ``configs`` (a short hash)."""
    plain = [json.dumps(to_plain(c), sort_keys=True) for c in configs]
    return job_id(kind, *plain)
