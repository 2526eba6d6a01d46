"""Who does each job of a shared study: claims that one process owns and that lapse.

A job (profiling, verifying one candidate, the final re-timing) is claimed by creating an
Optuna study named after the job and an attempt number. Creating a study is atomic in
every Optuna storage (a unique name in a database, an ordered log in a journal file), so
exactly one process creates attempt ``n``: it owns the job. While it works a thread beats,
writing the time into the claim every :data:`BEAT_S` seconds. A claim is **stale** when its
owner released it (interrupted), when its last beat is older than :data:`GRACE_S` (the
process was killed, its machine lost), or when it never beat and has been seen for that
long; the next process to look creates attempt ``n + 1`` and owns the job. So a job is
done (its result is in the study), or has a live owner, or can be taken over: a crash or
an interrupt loses nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import optuna
from optuna.exceptions import DuplicatedStudyError
from optuna.storages import BaseStorage
from optuna.study import StudyDirection

from autotune.plan._search import quiet_optuna
from autotune.verify._database import open_database

__all__ = ["BEAT_S", "GRACE_S", "Claims", "job_id"]

BEAT_S = 2.0
"""Seconds between two beats of a live claim."""
GRACE_S = 20.0
"""Seconds without a beat after which a claim's owner is taken for dead."""
_SEP = "~"


def job_id(*parts: str) -> str:
    """A short fixed-length name for a job (keys and names must not grow with the model)."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:20]


class Claims:
    """The claims of the jobs of study ``study`` in ``storage``, for process ``me``."""

    def __init__(self, storage: BaseStorage, study: str, me: str) -> None:
        self.storage = storage
        self.prefix = f"{study}{_SEP}claim{_SEP}"
        self.me = me
        self._first_seen: dict[str, float] = {}

    def claim(self, job: str) -> contextlib.AbstractContextManager[None] | None:
        """A context that owns ``job`` while it runs (beating; released on an error or an
        interrupt), or ``None`` when a live claim of another process holds it."""
        attempt, attrs = self._latest(job)
        stale = attempt < 0 or self._stale(job, attempt, attrs)
        if not stale and attrs.get("owner") != self.me:
            return None
        name = f"{self.prefix}{job}{_SEP}{attempt + 1}"
        try:
            with quiet_optuna():
                study_id = self.storage.create_new_study([StudyDirection.MAXIMIZE], name)
        except DuplicatedStudyError:
            return None  # another process took it between our look and our claim
        self.storage.set_study_user_attr(study_id, "owner", self.me)
        self.storage.set_study_user_attr(study_id, "beat", time.time())
        return self._owned(study_id)

    def live_elsewhere(self, job: str) -> bool:
        """Whether another process holds a live claim on ``job``."""
        attempt, attrs = self._latest(job)
        return (
            attempt >= 0 and attrs.get("owner") != self.me and not self._stale(job, attempt, attrs)
        )

    def _latest(self, job: str) -> tuple[int, dict[str, Any]]:
        """The highest attempt at ``job`` and its attributes (-1: never claimed)."""
        start = f"{self.prefix}{job}{_SEP}"
        attempts = {
            int(s.study_name[len(start) :]): s.user_attrs
            for s in self.storage.get_all_studies()
            if s.study_name.startswith(start)
        }
        if not attempts:
            return -1, {}
        attempt = max(attempts)
        return attempt, dict(attempts[attempt])

    def _stale(self, job: str, attempt: int, attrs: dict[str, Any]) -> bool:
        now = time.time()
        if attrs.get("released"):
            return True
        if "beat" in attrs:
            return now - float(attrs["beat"]) > GRACE_S
        # Created but never beat: its owner died in between, once it has been seen that long.
        seen = self._first_seen.setdefault(f"{job}{_SEP}{attempt}", now)
        return now - seen > GRACE_S

    @contextlib.contextmanager
    def _owned(self, study_id: int) -> Iterator[None]:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(BEAT_S):
                with contextlib.suppress(Exception):  # a missed beat is retried next time
                    self.storage.set_study_user_attr(study_id, "beat", time.time())

        thread = threading.Thread(target=beat, name="autotune-claim-beat", daemon=True)
        thread.start()
        try:
            yield
        except BaseException:
            # Interrupted or failed: the job is free for the next process at once.
            with contextlib.suppress(Exception):
                self.storage.set_study_user_attr(study_id, "released", True)
            raise
        finally:
            stop.set()
            thread.join()


def storage_of(storage: str | BaseStorage) -> BaseStorage:
    """The storage object behind a URL (or the storage itself).

    Workers started together on a new database race to create its tables; the losers'
    inserts fail on a unique constraint. Trying again finds the tables made.
    """
    for attempt in range(5):
        try:
            with quiet_optuna():
                database = open_database(storage) if isinstance(storage, str) else None
                return optuna.storages.get_storage(database or storage)
        except Exception as exc:
            if not type(exc).__module__.startswith("sqlalchemy") or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")
