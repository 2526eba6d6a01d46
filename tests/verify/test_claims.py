"""Claims in one process, step by step: who owns a job, when a claim lapses, the beat.

tests/verify/test_shared_studies.py runs them between real processes; these tests check
each rule on its own, on a SQLite storage, with the clock's grace shortened.
"""

from __future__ import annotations

import time

import optuna
import pytest

from autotune.verify import _claims
from autotune.verify._claims import Claims, storage_of


@pytest.fixture
def storage(tmp_path) -> optuna.storages.BaseStorage:
    return storage_of(f"sqlite:///{tmp_path / 'claims.db'}")


def test_one_process_owns_a_job_until_it_is_done(storage) -> None:
    a, b = Claims(storage, "s", "a"), Claims(storage, "s", "b")
    owned = a.claim("job")
    assert owned is not None
    with owned:
        assert b.claim("job") is None  # a live claim of another process
        assert b.live_elsewhere("job") and not a.live_elsewhere("job")


def test_a_claim_that_stops_beating_lapses(storage, monkeypatch) -> None:
    monkeypatch.setattr(_claims, "GRACE_S", 0.3)
    a, b = Claims(storage, "s", "a"), Claims(storage, "s", "b")
    assert a.claim("job") is not None  # and never entered: no beat after the first
    assert b.claim("job") is None
    time.sleep(0.5)
    assert not b.live_elsewhere("job")
    assert b.claim("job") is not None  # attempt 1, taken over


def test_a_live_claim_keeps_beating(storage, monkeypatch) -> None:
    monkeypatch.setattr(_claims, "GRACE_S", 0.5)
    monkeypatch.setattr(_claims, "BEAT_S", 0.05)
    a, b = Claims(storage, "s", "a"), Claims(storage, "s", "b")
    owned = a.claim("job")
    assert owned is not None
    with owned:
        time.sleep(1.0)  # twice the grace: only the beat keeps it
        assert b.live_elsewhere("job")


def test_an_interrupted_owner_releases_its_claim_at_once(storage) -> None:
    a, b = Claims(storage, "s", "a"), Claims(storage, "s", "b")
    owned = a.claim("job")
    assert owned is not None
    with pytest.raises(KeyboardInterrupt), owned:
        raise KeyboardInterrupt
    assert not b.live_elsewhere("job")
    assert b.claim("job") is not None


def test_a_claim_that_never_beat_lapses_once_seen_that_long(storage, monkeypatch) -> None:
    monkeypatch.setattr(_claims, "GRACE_S", 0.3)
    from optuna.study import StudyDirection

    # Its owner died between creating the claim and its first beat.
    storage.create_new_study([StudyDirection.MAXIMIZE], "s~claim~job~0")
    b = Claims(storage, "s", "b")
    assert b.claim("job") is None  # first seen now
    time.sleep(0.5)
    assert b.claim("job") is not None


def test_two_claims_of_the_same_attempt_one_wins(storage, monkeypatch) -> None:
    a, b = Claims(storage, "s", "a"), Claims(storage, "s", "b")
    # b looked before a claimed: it tries the same attempt, and the storage refuses it.
    monkeypatch.setattr(b, "_latest", lambda job: (-1, {}))
    assert a.claim("job") is not None
    assert b.claim("job") is None


def test_a_new_database_raced_by_workers_is_tried_again(monkeypatch, tmp_path) -> None:
    from sqlalchemy.exc import IntegrityError

    real, calls = optuna.storages.get_storage, []

    def racing(url: str) -> optuna.storages.BaseStorage:
        calls.append(url)
        if len(calls) == 1:  # another worker made the tables first
            raise IntegrityError("INSERT INTO alembic_version", {}, Exception("UNIQUE"))
        return real(url)

    monkeypatch.setattr(optuna.storages, "get_storage", racing)
    assert storage_of(f"sqlite:///{tmp_path / 'race.db'}") is not None
    assert len(calls) == 2
    monkeypatch.setattr(optuna.storages, "get_storage", lambda url: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # not a database race: raised at once
        storage_of("sqlite:///x.db")
