"""Claims in one process, step by step: who owns a job, when a claim lapses, the beat.

tests/jobs/test_shared_studies.py runs them between real processes; these tests check
each rule on its own, on a SQLite storage, with the clock's grace shortened.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import optuna
import pytest
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy

from autotune.jobs import _claims
from autotune.jobs._claims import Claim, Claims, storage_of


@pytest.fixture
def storage(tmp_path) -> optuna.storages.BaseStorage:
    out = storage_of(f"sqlite:///{tmp_path / 'claims.db'}")
    out.create_new_study([StudyDirection.MAXIMIZE], "s")
    return out


def of(storage, me: str) -> Claims:
    """Process ``me``'s claims on study ``s``."""
    return Claims(storage, "s", storage.get_study_id_from_name("s"), me)


def test_one_process_owns_a_job_until_it_is_done(storage) -> None:
    a, b = of(storage, "a"), of(storage, "b")
    owned = a.claim("job")
    assert owned is not None
    with owned:
        assert b.claim("job") is None  # a live claim of another process
        assert b.holder("job") is not None and a.holder("job") is None


def test_a_claim_that_stops_beating_lapses(storage, monkeypatch) -> None:
    monkeypatch.setattr(_claims, "GRACE_S", 0.3)
    a, b = of(storage, "a"), of(storage, "b")
    assert a.claim("job") is not None  # and never entered: no beat after the first
    assert b.claim("job") is None
    time.sleep(0.5)
    assert b.holder("job") is None
    assert b.claim("job") is not None  # attempt 1, taken over


def test_a_live_claim_keeps_beating(storage, monkeypatch) -> None:
    monkeypatch.setattr(_claims, "GRACE_S", 0.5)
    monkeypatch.setattr(_claims, "BEAT_S", 0.05)
    a, b = of(storage, "a"), of(storage, "b")
    owned = a.claim("job")
    assert owned is not None
    with owned:
        time.sleep(1.0)  # twice the grace: only the beat keeps it
        assert b.holder("job") is not None


def test_an_interrupted_owner_releases_its_claim_at_once(storage) -> None:
    a, b = of(storage, "a"), of(storage, "b")
    owned = a.claim("job")
    assert owned is not None
    with pytest.raises(KeyboardInterrupt), owned:
        raise KeyboardInterrupt
    assert b.holder("job") is None
    assert b.claim("job") is not None


def test_a_claim_that_never_beat_lapses_once_seen_that_long(storage, monkeypatch) -> None:
    monkeypatch.setattr(_claims, "GRACE_S", 0.3)
    # Its owner died between creating the claim and its first beat.
    storage.create_new_study([StudyDirection.MAXIMIZE], "s~claim~job~0")
    b = of(storage, "b")
    assert b.claim("job") is None  # first seen now
    time.sleep(0.5)
    assert b.claim("job") is not None


def test_two_claims_of_the_same_attempt_one_wins(storage, monkeypatch) -> None:
    a, b = of(storage, "a"), of(storage, "b")
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


def studies(storage) -> list[str]:
    return sorted(optuna.get_all_study_names(storage))


def test_a_committed_job_is_read_by_all_and_leaves_no_claims(storage) -> None:
    a, b = of(storage, "a"), of(storage, "b")
    owned = a.claim("job")
    assert owned is not None
    with owned as claim:
        assert b.result("job") is None
        claim.commit({"speed": 1.0})
    assert a.result("job") == b.result("job") == {"speed": 1.0}
    assert studies(storage) == ["s"]  # the claim and its commit marker are gone


@contextlib.contextmanager
def taken_over(storage, monkeypatch) -> Iterator[tuple[Claims, Claims, Claim, Claim]]:
    """a owns the job and goes silent past the grace period (paused: it beats no more); b
    takes it over. Yields a, b, a's claim (entered) and b's (attempt 1, to enter)."""
    monkeypatch.setattr(_claims, "GRACE_S", 0.3)
    monkeypatch.setattr(_claims, "BEAT_S", 60.0)
    a, b = of(storage, "a"), of(storage, "b")
    late = a.claim("job")
    assert late is not None
    with late as paused:
        time.sleep(0.5)
        taken = b.claim("job")
        assert taken is not None
        yield a, b, paused, taken


def test_a_paused_owner_whose_job_was_taken_over_drops_its_result(storage, monkeypatch) -> None:
    with taken_over(storage, monkeypatch) as (a, b, paused, taken), taken as claim:
        paused.commit("a's")  # a wakes first: slot 1 is b's claim, the commit fails
        assert a.result("job") is None and b.result("job") is None
        claim.commit("b's")
    assert a.result("job") == b.result("job") == "b's"
    assert studies(storage) == ["s"]


def test_an_owner_that_commits_after_the_job_was_tidied_is_dropped(storage, monkeypatch) -> None:
    with taken_over(storage, monkeypatch) as (a, b, paused, taken):
        with taken as claim:
            claim.commit("b's")  # published, every claim deleted: slot 1 is free again
        paused.commit("a's")  # its claim was deleted with the others: dropped
    assert a.result("job") == b.result("job") == "b's"
    assert studies(storage) == ["s"]


def test_a_commit_whose_owner_died_before_publishing_is_published_by_a_reader(storage) -> None:
    a = of(storage, "a")
    claim_id = storage.create_new_study([StudyDirection.MAXIMIZE], "s~claim~job~0")
    storage.set_study_user_attr(claim_id, "result", [1, 2])
    storage.create_new_study([StudyDirection.MINIMIZE], "s~claim~job~1")  # the marker
    assert a.result("job") == [1, 2]
    assert a.published("job") == [1, 2] and studies(storage) == ["s"]


def test_a_claim_of_a_process_gone_from_this_machine_lapses_at_once(storage) -> None:
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claim_id = storage.create_new_study([StudyDirection.MAXIMIZE], "s~claim~job~0")
    for key, value in (("owner", "x"), ("machine", _claims._this_machine()), ("pid", dead.pid)):
        storage.set_study_user_attr(claim_id, key, value)
    storage.set_study_user_attr(claim_id, "beat", time.time())  # beat just now
    b = of(storage, "b")
    assert b.holder("job") is None
    assert b.claim("job") is not None  # no grace period to wait out


def test_a_waiting_process_is_told_who_holds_the_job(storage) -> None:
    a, b = of(storage, "a"), of(storage, "b")
    owned = a.claim("job")
    assert owned is not None
    with owned:
        holder = b.holder("job")
        assert holder is not None and holder.pid == os.getpid()
        assert holder.machine == _claims._this_machine() and 0 <= holder.silent_s < 5


def test_the_first_published_result_is_final(storage) -> None:
    a = of(storage, "a")
    owned = a.claim("job")
    assert owned is not None
    with owned as claim:
        # Another process published the job and stopped before deleting the claims.
        storage.set_study_user_attr(storage.get_study_id_from_name("s"), "result:job", "b's")
        claim.commit("a's")  # its marker is made, and it finds the job published
    assert a.result("job") == "b's"
    assert studies(storage) == ["s"]


def test_a_claim_deleted_while_the_storage_is_read_is_not_seen(storage, monkeypatch) -> None:
    # What a database storage returns for a claim that another process's tidy() deleted
    # between its query of the names and its query of the directions: no direction.
    a = of(storage, "a")
    storage.create_new_study([StudyDirection.MAXIMIZE], "s~claim~job~0")
    read = storage.get_all_studies

    def racing() -> list[FrozenStudy]:
        seen = read()
        for s in seen:
            if "claim" in s.study_name:
                s._directions = []
        return seen

    monkeypatch.setattr(storage, "get_all_studies", racing)
    assert a.holder("job") is None and a.result("job") is None


def test_a_claim_tidied_away_as_it_is_made_is_given_up(storage, monkeypatch) -> None:
    a, b = of(storage, "a"), of(storage, "b")
    make = storage.create_new_study

    def then_published(directions, name):  # b publishes the job the instant a's claim exists
        made = make(directions, name)
        if name.startswith("s~claim~"):
            monkeypatch.setattr(a, "published", lambda job: None)  # a looked just before
            b.publish("job", "b's")
        return made

    monkeypatch.setattr(storage, "create_new_study", then_published)
    assert a.claim("job") is None
    assert b.result("job") == "b's" and studies(storage) == ["s"]


def test_a_claim_made_after_the_job_was_published_is_not_left_behind(storage) -> None:
    a, b = of(storage, "a"), of(storage, "b")
    owned = a.claim("job")
    assert owned is not None
    with owned as claim:
        claim.commit("a's")
    # b looked before a published (it saw no result) and claims now.
    assert b.claim("job") is None
    assert studies(storage) == ["s"]
