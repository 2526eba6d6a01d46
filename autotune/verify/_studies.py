"""Keeping a tuning run in an Optuna storage, to resume it or share it between processes.

The study holds, besides its trials on the cost model, what is expensive to redo: the
measured profile and every verification outcome. A run that finds them there skips that
work; processes working on one study claim a candidate before they verify it.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import optuna
from optuna.storages.journal import JournalFileBackend

from autotune._plain import from_plain, to_plain
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.measure._profile_data import Profile, profile_from_json, profile_to_json
from autotune.plan._search import quiet_optuna
from autotune.result import TrialRecord

__all__ = ["StudyStore", "resolve_storage"]


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
        key: What the study was made for (model fingerprint, budget, space, device); a
            study made for something else is an error rather than silently mixed.
    """

    def __init__(
        self, storage: str | optuna.storages.BaseStorage, name: str, key: dict[str, Any]
    ) -> None:
        self.storage = storage
        self.name = name
        with quiet_optuna():  # "A new study created in ..." is not ours to print
            self.study = optuna.create_study(
                storage=storage, study_name=name, direction="maximize", load_if_exists=True
            )
        made_for = self.study.user_attrs.get("autotune_key")
        if made_for is None:
            self.study.set_user_attr("autotune_key", key)
        elif made_for != key:
            changed = sorted(k for k in key if made_for.get(k) != key[k])
            raise ConfigError(
                f"study {name!r} was made for another tuning run ({', '.join(changed)} "
                "differ); pass another study name, or the same model, budget and space."
            )
        self.me = f"{socket.gethostname()}:{os.getpid()}"

    def profile(self) -> Profile | None:
        text = self.study.user_attrs.get("autotune_profile")
        return None if text is None else profile_from_json(text)

    def save_profile(self, profile: Profile) -> None:
        self.study.set_user_attr("autotune_profile", profile_to_json(profile))

    def record(self, config: TrainConfig) -> TrialRecord | None:
        data = self.study.user_attrs.get(self._key("verified", config))
        return None if data is None else from_plain(TrialRecord, data)

    def save_record(self, record: TrialRecord) -> None:
        self.study.set_user_attr(self._key("verified", record.config), to_plain(record))

    def claim(self, config: TrainConfig) -> bool:
        """True if this process may verify ``config`` (no other process claimed it)."""
        key = self._key("claim", config)
        owner = self.study.user_attrs.get(key)
        if owner not in (None, self.me):
            return False
        self.study.set_user_attr(key, self.me)
        return True

    def records(self) -> list[TrialRecord]:
        """Every verification outcome in the study, from any process."""
        return [
            from_plain(TrialRecord, v)
            for k, v in self.study.user_attrs.items()
            if k.startswith("verified:")
        ]

    @staticmethod
    def _key(kind: str, config: TrainConfig) -> str:
        return f"{kind}:" + json.dumps(to_plain(config), sort_keys=True)
