"""Keeping a tuning run in an Optuna storage, to resume it or share it between processes.

The study holds, besides its trials on the cost model, what is expensive to redo: the
measured profile, the search's candidates, every verification outcome and the final
timings. Each of these is a job that one process owns at a time (see
:mod:`autotune.jobs._claims`): processes on one study profile once, search once, verify
each candidate once and re-time once, and so all end with the same winner and the same
fallbacks. A killed or interrupted process loses nothing: its job lapses and another
process, or the next run, takes it over; a paused one that wakes after that drops its
own result for the one that counted. Keys are short hashes: they do not grow with
the model (PostgreSQL's key column holds 512 characters).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import optuna
from optuna.storages.journal import JournalFileBackend

from autotune.errors import ConfigError
from autotune.jobs import _claims
from autotune.jobs._claims import NAME_ROOM, Claims, quiet_optuna, storage_of
from autotune.jobs._job_store import PLAIN, Codec

__all__ = ["StudyStore", "resolve_storage"]

POLL_S = 0.5
"""Seconds between two looks at a job another process owns."""
_NAME_MAX = 512
"""The longest study name Optuna's database schema holds."""

log = logging.getLogger("autotune")

T = TypeVar("T")


def resolve_storage(url: str) -> str | optuna.storages.BaseStorage:
    """An Optuna storage from a URL, or from a file path: ``*.journal``/``*.log`` give a
    journal file (safe for many processes on one file system), any other path SQLite."""
    if "://" in url:
        return url
    path = Path(url)
    if path.suffix in (".journal", ".log"):
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    return f"sqlite:///{path}"


class StudyStore:
    """The autotune side of one Optuna study.

    Args:
        storage: What :func:`resolve_storage` returned.
        name: The study's name.
        key: What the study was made for (autotune's version, model fingerprint, budget,
            space, device); a study made for something else is an error rather than
            silently mixed.
    """

    def __init__(
        self, storage: str | optuna.storages.BaseStorage, name: str, key: dict[str, Any]
    ) -> None:
        try:
            self.storage = storage_of(storage)
        except ImportError as exc:  # a database URL whose driver is not installed
            raise ConfigError(
                f"the storage {str(storage)[:60]!r} needs a database driver: {exc}. For "
                "postgresql:// URLs: pip install 'autotune[postgres]'."
            ) from None
        if len(name) > _NAME_MAX - NAME_ROOM:
            raise ConfigError(
                f"the study name is {len(name)} characters long; at most "
                f"{_NAME_MAX - NAME_ROOM} fit (the database holds {_NAME_MAX} and autotune "
                f"adds up to {NAME_ROOM} for the names of its jobs): pass a shorter study_name."
            )
        self.name = name
        with quiet_optuna():
            self.study = optuna.create_study(
                storage=self.storage, study_name=name, direction="maximize", load_if_exists=True
            )
        self._id = self.storage.get_study_id_from_name(name)
        made_for = self.study.user_attrs.get("autotune_key")
        if made_for is None:
            self.study.set_user_attr("autotune_key", key)
        elif made_for != key:
            changed = sorted(k for k in key if made_for.get(k) != key[k])
            raise ConfigError(
                f"study {name!r} was made for another tuning run ({', '.join(changed)} "
                "differ); pass another study name, or the same model, budget and space."
            )
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.claims = Claims(self.storage, name, self._id, self.me)

    def once(self, job: str, do: Callable[[], T], what: str, codec: Codec = PLAIN) -> T:
        """``job``'s result: read if done, else done here if no live process owns it,
        else waited for (and taken over if its owner goes silent). Every process gets
        the same result, as read back from the storage: a late owner's is dropped (see
        :mod:`._claims`).

        Args:
            job: Its key (:func:`~autotune.jobs._job_store.job_key`).
            do: Does the job.
            what: The job in words, for the message that says what a run waits for.
            codec: How the result is written as JSON-able data and read back.
        """
        told: set[tuple[str, int]] = set()
        while True:
            result = self.claims.result(job)
            if result is not None:
                decoded: T = codec.decode(result)
                return decoded
            owned = self.claims.claim(job)
            if owned is not None:
                with owned as claim:
                    if self.claims.result(job) is None:  # done between our look and claim
                        claim.commit(codec.encode(do()))
                continue
            holder = self.claims.holder(job)
            if holder is not None and (holder.machine, holder.pid) not in told:
                told.add((holder.machine, holder.pid))
                log.info(
                    "waiting for process %d on %s, which is %s (taken over if it stays "
                    "silent for %.0f s; it last answered %.0f s ago)",
                    holder.pid,
                    holder.machine.split("pid:")[0],
                    what,
                    _claims.GRACE_S,
                    holder.silent_s,
                )
            time.sleep(POLL_S)
