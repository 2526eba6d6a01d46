"""Keeping a tuning run in an Optuna storage, to resume it or share it between processes.

The study holds, besides its trials on the cost model, what is expensive to redo: the
measured profile, the search's candidates, every verification outcome and the final
timings. Each of these is a job that one process owns at a time (see
:mod:`autotune.verify._claims`): processes on one study profile once, search once, verify
each candidate once and re-time once, and so all end with the same winner and the same
fallbacks. A killed or interrupted process loses nothing: its job lapses and another
process, or the next run, takes it over. Keys are short hashes: they do not grow with
the model (PostgreSQL's key column holds 512 characters).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import optuna
from optuna.storages.journal import JournalFileBackend

from autotune._plain import from_plain, to_plain
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.measure._profile_data import Profile, profile_from_json, profile_to_json
from autotune.plan._search import quiet_optuna
from autotune.result import TrialRecord
from autotune.verify._claims import Claims, job_id, storage_of

__all__ = ["StudyStore", "resolve_storage"]

T = TypeVar("T")

POLL_S = 0.5
"""Seconds between two looks at a job another process owns."""


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
        self.claims = Claims(self.storage, name, self.me)

    def once(self, job: str, done: Callable[[], T | None], do: Callable[[], T]) -> T:
        """``job``'s result: read if done, else done here if no live process owns it, else
        waited for (and taken over if its owner stops beating)."""
        while True:
            result = done()
            if result is not None:
                return result
            owned = self.claims.claim(job)
            if owned is not None:
                with owned:
                    result = done()  # done between our look and our claim
                    return result if result is not None else do()
            time.sleep(POLL_S)

    def profile(self) -> Profile | None:
        text = self.study.user_attrs.get("autotune_profile")
        return None if text is None else profile_from_json(text)

    def save_profile(self, profile: Profile) -> None:
        self.study.set_user_attr("autotune_profile", profile_to_json(profile))

    def record(self, config: TrainConfig) -> TrialRecord | None:
        data = self._attrs().get(self._key("verified", config))
        return None if data is None else from_plain(TrialRecord, data)

    def save_record(self, record: TrialRecord) -> None:
        self.study.set_user_attr(self._key("verified", record.config), to_plain(record))

    def records(self) -> list[TrialRecord]:
        """Every verification outcome in the study, from any process."""
        return [
            from_plain(TrialRecord, v)
            for k, v in self._attrs().items()
            if k.startswith("verified:")
        ]

    def configs(self, job: str) -> list[TrainConfig] | None:
        """The configs a job saved with :meth:`save_configs` (``None``: not yet)."""
        data = self._attrs().get(f"configs:{job}")
        return None if data is None else [from_plain(TrainConfig, c) for c in data]

    def save_configs(self, job: str, configs: list[TrainConfig]) -> None:
        self.study.set_user_attr(f"configs:{job}", [to_plain(c) for c in configs])

    def flag(self, job: str) -> bool | None:
        """``True`` once :meth:`set_flag` marked ``job`` done (``None``: not yet)."""
        return True if self._attrs().get(f"done:{job}") else None

    def set_flag(self, job: str) -> None:
        self.study.set_user_attr(f"done:{job}", True)

    def job_of(self, kind: str, *configs: TrainConfig) -> str:
        """The job of ``kind`` over ``configs`` (a short hash)."""
        plain = [json.dumps(to_plain(c), sort_keys=True) for c in configs]
        return job_id(kind, *plain)

    def _attrs(self) -> dict[str, Any]:
        return self.storage.get_study_user_attrs(self._id)

    def _key(self, kind: str, config: TrainConfig) -> str:
        return f"{kind}:{self.job_of(kind, config)}"
