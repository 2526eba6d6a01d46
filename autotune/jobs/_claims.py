"""Who does each job of a shared study, and whose result counts: fenced claims that lapse.

A job (profiling, verifying one candidate, the final re-timing) is claimed by creating an
Optuna study named after the job and an attempt number. Creating a study is atomic in
every Optuna storage (a unique name in a database, an ordered log in a journal file), so
exactly one process creates attempt ``n``: it owns the job. While it works a thread beats,
writing the time into the claim every :data:`BEAT_S` seconds. A claim is **stale** when its
owner released it (interrupted), when its owner's process is gone (same machine), when its
last beat is older than :data:`GRACE_S` (killed elsewhere, its machine lost, or paused),
or when it never beat and has been seen for that long; the next process to look creates
attempt ``n + 1`` and owns the job.

A stale claim's owner may still be alive (a process paused past the grace period, then
continued), so a result counts only through a **fenced commit**: the owner of attempt
``n`` writes its result into its own claim, then creates slot ``n + 1`` as a commit
marker (a study made to *minimize*, the one property a study has from the instant it
exists). If another process took the job over, slot ``n + 1`` is its claim and the
creation fails: the late owner's result is dropped and it reads the one that counted. A
committed result is then published into the main study under ``result:<job>`` and the
job's claims are deleted, so a finished run leaves only its study in the storage. The
first publication is final: an owner that commits after the claims were tidied away
finds the result published and drops its own.

Opening a study's database (:func:`open_database`): a server that never answers is an
error in seconds. An Optuna URL (``postgresql+psycopg://...``, ``mysql://...``) opens
with SQLAlchemy's defaults, which wait for a connection for ever: a server that accepts
the TCP connection and never answers hangs the tuner before any work. autotune connects
with a timeout (the URL's own ``connect_timeout`` where it gives one) and turns a
connection that fails into one line that names the server and says what to check.
Optuna's own log is kept quiet while autotune calls it (:func:`quiet_optuna`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

import optuna
from optuna.exceptions import DuplicatedStudyError
from optuna.storages import BaseStorage
from optuna.study import StudyDirection

from autotune.errors import ConfigError

__all__ = [
    "BEAT_S",
    "CONNECT_TIMEOUT_S",
    "GRACE_S",
    "NAME_ROOM",
    "Claim",
    "Claims",
    "Holder",
    "open_database",
    "quiet_optuna",
    "storage_of",
]

BEAT_S = 2.0
"""Seconds between two beats of a live claim."""
GRACE_S = 20.0
"""Seconds without a beat after which a claim's owner is taken for dead."""
NAME_ROOM = 40
"""Characters a claim adds to its study's name (``~claim~``, a 20-character job, the
attempt): a study name may be this much shorter than the storage's longest."""
_SEP = "~"
_CLAIM = StudyDirection.MAXIMIZE
_COMMIT = StudyDirection.MINIMIZE


def _this_machine() -> str:
    """This host, and its process-id namespace: two containers may share a host name."""
    try:
        space = os.readlink("/proc/self/ns/pid")
    except OSError:
        space = ""
    return f"{socket.gethostname()}{space}"


def _gone(machine: str, pid: int) -> bool:
    """Whether process ``pid`` on ``machine`` surely no longer runs (here only)."""
    if machine != _this_machine() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it runs
        return False
    return False


class _Attempt(NamedTuple):
    name: str
    direction: StudyDirection
    user_attrs: dict[str, Any]


@dataclass(frozen=True)
class Holder:
    """The process that holds a live claim on a job, as a waiting process tells it."""

    machine: str
    pid: int
    silent_s: float
    """Seconds since its last beat."""


class Claim:
    """Attempt ``attempt`` at a job, owned by this process while its context runs."""

    def __init__(self, claims: Claims, job: str, attempt: int, study_id: int) -> None:
        self._claims, self.job, self.attempt, self._id = claims, job, attempt, study_id

    def commit(self, result: Any) -> None:
        """Make ``result`` (JSON-able) the job's, unless the claim was lost meanwhile:
        then another process took the job over (this one was paused or cut off past the
        grace period) and its result, read with :meth:`Claims.result`, is the job's."""
        storage = self._claims.storage
        try:
            storage.set_study_user_attr(self._id, "result", result)
        except KeyError:
            return  # the claim was tidied away: the job is done
        try:
            with quiet_optuna():
                storage.create_new_study([_COMMIT], self._claims.name(self.job, self.attempt + 1))
        except DuplicatedStudyError:
            return  # fenced: attempt + 1 is another process's claim
        if self._claims.published(self.job) is None:
            self._claims.publish(self.job, result)
        else:  # committed after the job was done and its claims tidied away
            self._claims.tidy(self.job)


class Claims:
    """The claims of the jobs of study ``study`` (id ``study_id``) in ``storage``, for
    process ``me``."""

    def __init__(self, storage: BaseStorage, study: str, study_id: int, me: str) -> None:
        self.storage = storage
        self.prefix = f"{study}{_SEP}claim{_SEP}"
        self.me = me
        self._study_id = study_id
        self._machine = _this_machine()
        self._first_seen: dict[str, float] = {}

    def name(self, job: str, attempt: int) -> str:
        return f"{self.prefix}{job}{_SEP}{attempt}"

    def result(self, job: str) -> Any | None:
        """``job``'s committed result, or ``None`` while it has none."""
        published = self.published(job)
        if published is not None:
            return published
        attempts = self._attempts(job)
        if not attempts or max(attempts) - 1 not in attempts:
            return None
        last = attempts[max(attempts)]
        if last.direction != _COMMIT:
            return None
        # Committed, not yet published: its owner stopped in between. Publish for it.
        result = attempts[max(attempts) - 1].user_attrs.get("result")
        if result is not None:
            self.publish(job, result)
        return result

    def published(self, job: str) -> Any | None:
        return self.storage.get_study_user_attrs(self._study_id).get(f"result:{job}")

    def publish(self, job: str, result: Any) -> None:
        self.storage.set_study_user_attr(self._study_id, f"result:{job}", result)
        self.tidy(job)

    def tidy(self, job: str) -> None:
        """Delete ``job``'s claims: its result is published, no one needs them again."""
        for seen in self._attempts(job).values():
            with contextlib.suppress(Exception):  # deleted by another process meanwhile
                self.storage.delete_study(self.storage.get_study_id_from_name(seen.name))

    def claim(self, job: str) -> contextlib.AbstractContextManager[Claim] | None:
        """A context that owns ``job`` while it runs (beating; released on an error or an
        interrupt), or ``None`` when a live claim of another process holds it."""
        attempt, attrs = self._latest(job)
        if attempt >= 0 and not self._stale(job, attempt, attrs) and attrs.get("owner") != self.me:
            return None
        try:
            with quiet_optuna():
                study_id = self.storage.create_new_study([_CLAIM], self.name(job, attempt + 1))
        except DuplicatedStudyError:
            return None  # another process took it between our look and our claim
        if self.published(job) is not None:
            # Published since our look: whoever published tidied before our claim existed.
            self.tidy(job)
            return None
        try:
            for key, value in (("owner", self.me), ("machine", self._machine)):
                self.storage.set_study_user_attr(study_id, key, value)
            self.storage.set_study_user_attr(study_id, "pid", os.getpid())
            self.storage.set_study_user_attr(study_id, "beat", time.time())
        except KeyError:
            return None  # published meanwhile and our claim tidied away with the others
        return self._owned(Claim(self, job, attempt + 1, study_id))

    def holder(self, job: str) -> Holder | None:
        """The other process that holds a live claim on ``job``, if one does."""
        attempt, attrs = self._latest(job)
        if attempt < 0 or attrs.get("owner") == self.me or self._stale(job, attempt, attrs):
            return None
        silent = time.time() - float(attrs.get("beat", time.time()))
        return Holder(str(attrs.get("machine", "?")), int(attrs.get("pid", 0)), silent)

    def _attempts(self, job: str) -> dict[int, _Attempt]:
        """``job``'s claims and commit marker in the storage, by attempt."""
        start = f"{self.prefix}{job}{_SEP}"
        return {
            int(s.study_name[len(start) :]): _Attempt(s.study_name, s.directions[0], s.user_attrs)
            for s in self.storage.get_all_studies()
            # A study deleted between the storage's queries of names and of directions
            # comes back without a direction: it is gone.
            if s.study_name.startswith(start) and s.directions
        }

    def _latest(self, job: str) -> tuple[int, dict[str, Any]]:
        """The highest attempt at ``job`` and its attributes (-1: never claimed)."""
        attempts = self._attempts(job)
        if not attempts:
            return -1, {}
        attempt = max(attempts)
        return attempt, dict(attempts[attempt].user_attrs)

    def _stale(self, job: str, attempt: int, attrs: dict[str, Any]) -> bool:
        now = time.time()
        if attrs.get("released"):
            return True
        if _gone(str(attrs.get("machine", "")), int(attrs.get("pid", 0))):
            return True  # its process ended on this machine: no need to wait
        if "beat" in attrs:
            return now - float(attrs["beat"]) > GRACE_S
        # Created but never beat: its owner died in between, once it has been seen that long.
        seen = self._first_seen.setdefault(f"{job}{_SEP}{attempt}", now)
        return now - seen > GRACE_S

    @contextlib.contextmanager
    def _owned(self, claim: Claim) -> Iterator[Claim]:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(BEAT_S):
                with contextlib.suppress(Exception):  # a missed beat is retried next time
                    self.storage.set_study_user_attr(claim._id, "beat", time.time())

        thread = threading.Thread(target=beat, name="autotune-claim-beat", daemon=True)
        thread.start()
        try:
            yield claim
        except BaseException:
            # Interrupted or failed: the job is free for the next process at once.
            with contextlib.suppress(Exception):
                self.storage.set_study_user_attr(claim._id, "released", True)
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


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna logs every trial and every study it creates at INFO on stderr; autotune's
    progress goes to the ``autotune`` logger only. Silenced while autotune calls Optuna,
    and the user's verbosity comes back after."""
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)


CONNECT_TIMEOUT_S = 10
"""Seconds to wait for a database server, where the URL does not say
(``?connect_timeout=N``)."""

_TIMEOUT_ARG = {"postgresql": "connect_timeout", "mysql": "connect_timeout"}
"""The driver argument that bounds the wait for a connection, by URL scheme."""


def open_database(url: str) -> BaseStorage | None:
    """Optuna's storage on the database ``url`` names, connected with a timeout; ``None``
    for a URL of another kind (SQLite, a journal), which opens as Optuna opens it.

    Raises:
        ConfigError: the server cannot be reached in time, or refuses the connection.
    """
    parts = urlsplit(url)
    dialect = parts.scheme.split("+")[0]
    arg = _TIMEOUT_ARG.get(dialect)
    if arg is None:
        return None
    given = parse_qs(parts.query).get(arg)
    timeout = int(given[0]) if given and given[0].isdigit() else CONNECT_TIMEOUT_S
    connect = {} if given else {arg: timeout}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": connect})
    except Exception as exc:
        if type(exc).__name__ != "OperationalError":  # SQLAlchemy's: no connection
            raise
        server = f"{parts.hostname or 'localhost'}:{parts.port or 'default port'}"
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0][:160]
        raise ConfigError(
            f"cannot open the study database at {server} within {timeout} s ({reason}). "
            "Check that the server runs and accepts connections there, the user and the "
            f"database name; set a longer wait with ?{arg}=SECONDS in the URL."
        ) from None
