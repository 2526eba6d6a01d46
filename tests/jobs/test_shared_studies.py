"""Studies shared by real worker processes: one owner per job, nothing lost to a crash.

Workers are real processes on one storage (a journal file, SQLite, and PostgreSQL where
CI runs a server). One is killed with SIGKILL, or interrupted with SIGINT, in the middle
of a verification; the next process takes its job over and no candidate is lost.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from sweeps import sweep

from autotune.jobs._study_store import resolve_storage

BUDGET_GB = 48 / 1024
POSTGRES = os.environ.get("AUTOTUNE_TEST_POSTGRES")
"""A PostgreSQL URL (``.ci/run`` starts a server and sets it)."""

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time, torch
    # Ctrl-C raises KeyboardInterrupt even where the suite runs as a background job, whose
    # shell had its children ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    import autotune
    from autotune.models import gpt_batch, tiny_gpt
    from autotune.jobs import _claims
    from autotune.verify import _verifier
    _claims.BEAT_S = 0.2
    _claims.GRACE_S = float(os.environ.get("GRACE_S", "600"))
    import autotune.tuning._data_parallel as layouts
    import autotune.tuning._device_run as tuning
    import autotune.verify._verification as verification
    hang, marker = int(os.environ.get("HANG_AT", "0")), os.environ.get("MARKER", "")
    stage = os.environ.get("HANG_IN", "record")
    where = {{"record": (_verifier.Verifier, "record"), "retime_contenders": (verification, "retime_contenders"),
             "profile": (tuning, "profile_model"), "search": (layouts, "search")}}[stage]
    original, seen = getattr(*where), []

    def hanging(*args, **kwargs):  # the test kills or interrupts us in here
        seen.append(1)
        if len(seen) == hang:
            with open(marker, "w") as f:
                config = args[1] if len(args) > 1 else None
                json.dump(getattr(config, "describe", lambda: stage)(), f)
            time.sleep(float(os.environ.get("HANG_S", "3600")))
        return original(*args, **kwargs)

    setattr(*where, hanging)
    layers = int(os.environ.get("LAYERS", "2"))
    m = tiny_gpt(n_layer=layers, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    r = autotune.autotune(m, gpt_batch(m.config, 4), {budget}, device="cpu",
                          global_batch_size=16, storage=sys.argv[1], study_name="shared",
                          n_trials=20, space=autotune.SearchSpace(precisions=("fp32",),
                          selective_checkpointing=False))  # the jobs, not the knobs
    print(json.dumps({{
        "winner": r.config.describe(),
        "fallbacks": [f.describe() for f in r.fallbacks],
        "trials": sorted(t.config.describe() for t in r.trials),
        "speeds": {{t.config.describe(): t.measured and t.measured.samples_per_s
                   for t in r.trials}},
        "verified_here": len(seen),
    }}))
    """
)


def storages(tmp_path: Path) -> dict[str, str]:
    out = {"journal": str(tmp_path / "s.journal"), "sqlite": str(tmp_path / "s.db")}
    if POSTGRES:
        out["postgres"] = POSTGRES
    return out


def start(tmp_path: Path, storage: str, **env: str) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(budget=BUDGET_GB))
    return subprocess.Popen(
        [sys.executable, str(script), storage],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 600) -> dict[str, object]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # and reaped: nothing left running into the next test
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def wait_for(marker: Path, proc: subprocess.Popen[str]) -> str:
    for _ in range(1200):
        if marker.exists() and marker.read_text():
            return json.loads(marker.read_text())
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    raise AssertionError("the worker never reached the verification it hangs in")


@contextlib.contextmanager
def opened(storage: str) -> Iterator[optuna.storages.BaseStorage]:
    """The storage at ``storage``, its database connections closed afterwards."""
    resolved = resolve_storage(storage)
    db = optuna.storages.RDBStorage(resolved) if isinstance(resolved, str) else None
    try:
        yield db if db is not None else resolved  # type: ignore[misc]
    finally:
        if db is not None:
            db.engine.dispose()


def studies(storage: str) -> list[str]:
    """The names of the studies in ``storage``."""
    with opened(storage) as db:
        return sorted(optuna.get_all_study_names(db))


def fresh(kind: str, tmp_path: Path, name: str) -> str:
    """A storage of ``kind`` that no earlier test used."""
    if kind == "postgres":
        return _postgres_database()
    return storages(tmp_path / name)[kind] if (tmp_path / name).mkdir() is None else ""


def _postgres_database() -> str:
    """A new database on the server, dropped when the suite's process ends: tests that run
    at once (in two workers) never see each other's tables."""
    assert POSTGRES is not None
    from sqlalchemy import create_engine, make_url, text

    name = f"autotune_{uuid.uuid4().hex[:12]}"
    server = create_engine(POSTGRES, isolation_level="AUTOCOMMIT")
    with server.connect() as db:
        db.execute(text(f"CREATE DATABASE {name}"))

    def drop() -> None:
        with server.connect() as db:
            db.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        server.dispose()

    atexit.register(drop)
    return make_url(POSTGRES).set(database=name).render_as_string(hide_password=False)


KINDS = ["journal", "sqlite", "postgres"]


def kind_param(kind: str, representative: str | None = None) -> object:
    """A storage kind as a parameter: PostgreSQL's skipped where no server runs (never in
    CI); with ``representative``, every other kind is a case of the sweep (``-m sweep``)."""
    skip = kind == "postgres" and not POSTGRES and os.environ.get("CI") != "true"
    marks = [pytest.mark.skipif(skip, reason="no PostgreSQL server")]
    if representative is not None and kind != representative:
        marks.append(pytest.mark.sweep)
    return pytest.param(kind, marks=marks)


@pytest.mark.parametrize("kind", [kind_param(k, "sqlite") for k in KINDS])
def test_two_workers_end_with_the_same_winner_and_fallbacks(tmp_path, kind: str) -> None:
    storage = fresh(kind, tmp_path, "two")
    workers = [start(tmp_path, storage) for _ in range(2)]
    first, second = (finish(w) for w in workers)
    assert first["winner"] == second["winner"]
    assert first["fallbacks"] == second["fallbacks"]
    assert first["trials"] == second["trials"] and first["speeds"] == second["speeds"]
    # One process verified each candidate, and the storage holds the study alone.
    assert first["verified_here"] + second["verified_here"] == len(first["trials"])
    assert studies(storage) == ["shared"]


@pytest.mark.parametrize(
    ("kind", "stage", "at"),
    sweep(
        [
            ("journal", "profile", "1"),
            ("sqlite", "search", "1"),
            ("journal", "record", "2"),  # verifying the second candidate
            ("sqlite", "record", "2"),
            ("sqlite", "retime_contenders", "1"),  # re-timing the contenders
        ],
        [("journal", "profile", "1"), ("sqlite", "record", "2")],  # the first and the middle
    ),
)
def test_a_worker_killed_at_any_stage_loses_nothing(
    tmp_path, kind: str, stage: str, at: str
) -> None:
    storage = fresh(kind, tmp_path, "kill")
    marker = tmp_path / "hang"
    doomed = start(tmp_path, storage, HANG_IN=stage, HANG_AT=at, MARKER=str(marker))
    hung = wait_for(marker, doomed)
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate(timeout=60)
    # Its process is gone from this machine: the next run takes the job over at once
    # (a grace of 10 minutes would time the test out).
    after = finish(start(tmp_path, storage, GRACE_S="600"), timeout=300)
    if stage == "record":
        assert hung in after["trials"]
    assert studies(storage) == ["shared"]  # the killed job's claim is tidied with the rest
    # A run after that reads everything and verifies nothing again.
    again = finish(start(tmp_path, storage))
    assert again["verified_here"] == 0 and again["winner"] == after["winner"]


@pytest.mark.parametrize("kind", [kind_param(k, "postgres") for k in KINDS])
def test_a_worker_paused_past_the_grace_period_ends_with_the_study_s_winner(
    tmp_path, kind: str
) -> None:
    # The owner of a verification is paused (SIGSTOP) past the grace period; another
    # worker takes the job over and finishes the run; the paused one is continued and
    # finishes its verification too. Its result must not count: both processes, and any
    # run after them, read the one that did.
    storage = fresh(kind, tmp_path, "pause")
    marker = tmp_path / "hang"
    paused = start(tmp_path, storage, HANG_AT="2", HANG_S="2", MARKER=str(marker), GRACE_S="1.5")
    hung = wait_for(marker, paused)
    paused.send_signal(signal.SIGSTOP)
    try:
        other = finish(start(tmp_path, storage, GRACE_S="1.5"))
    finally:
        paused.send_signal(signal.SIGCONT)
    woken = finish(paused)
    assert woken["verified_here"] >= 2  # it did finish the verification it was paused in
    assert hung in other["trials"]
    assert woken["winner"] == other["winner"] and woken["fallbacks"] == other["fallbacks"]
    assert woken["speeds"] == other["speeds"]  # the same measurement of every candidate
    third = finish(start(tmp_path, storage))
    assert third["verified_here"] == 0 and third["speeds"] == other["speeds"]
    assert studies(storage) == ["shared"]


def test_an_interrupted_worker_releases_its_claim_at_once(tmp_path) -> None:
    storage = fresh("sqlite", tmp_path, "int")
    marker = tmp_path / "hang"
    stopped = start(tmp_path, storage, HANG_AT="1", MARKER=str(marker))
    hung = wait_for(marker, stopped)
    stopped.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = stopped.communicate(timeout=60)
    assert stopped.returncode != 0 and "KeyboardInterrupt" in err
    # A grace of 10 minutes: only a released claim lets this run finish in time.
    after = finish(start(tmp_path, storage, GRACE_S="600"), timeout=300)
    assert hung in after["trials"]


@pytest.mark.parametrize("kind", [kind_param("postgres")])
def test_the_jobs_of_a_64_block_config_fit_the_database(kind: str, tmp_path) -> None:
    # Keys once held the config as JSON: past ~20 checkpointed blocks, over PostgreSQL's
    # 512-character key column. They are short hashes now, whatever the config. (SQLite
    # has no such limit. A whole tuning run of a 64-block model, which once checked this
    # here, takes 5 minutes: `benchmarks/shared_study.py` runs one.)
    from autotune import TrainConfig
    from autotune.jobs._job_store import job_key
    from autotune.jobs._study_store import StudyStore

    blocks = tuple(f"model.transformer.h.{i}" for i in range(64))
    deep = TrainConfig(checkpoint=blocks[::2], selective_checkpoint=blocks[1::2])
    with opened(fresh(kind, tmp_path, "deep")) as db:  # its connections closed after
        store = StudyStore(db, "deep", {"blocks": list(blocks)})
        for job in (
            job_key("verify", deep),
            job_key("retime_contenders", deep, deep.replace(checkpoint=())),
        ):
            assert store.once(job, deep.describe, "verifying") == deep.describe()
        for name in optuna.get_all_study_names(db):
            assert len(name) < 100
            study = optuna.load_study(study_name=name, storage=db)
            assert all(len(k) < 100 for k in study.user_attrs)
