"""Kept studies: resuming a tuning run, and two processes sharing one study."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import optuna
import pytest

import autotune
from autotune._plain import from_plain
from autotune.errors import ConfigError
from autotune.models import gpt_batch, tiny_gpt
from autotune.verify._studies import StudyStore, resolve_storage

BUDGET_GB = 48 / 1024


def model():
    return tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)


def tune(storage: str, study_name: str = "s", **kwargs):
    m = model()
    return autotune.autotune(
        m,
        gpt_batch(m.config, 4),
        BUDGET_GB,
        device="cpu",
        global_batch_size=16,
        storage=storage,
        study_name=study_name,
        n_trials=20,
        **kwargs,
    )


def test_resume_reuses_the_profile_and_the_verifications(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "tune.db")
    first = tune(path)
    store = StudyStore(
        resolve_storage(path),
        "s",
        optuna.load_study(study_name="s", storage=f"sqlite:///{path}").user_attrs["autotune_key"],
    )
    assert store.profile() is not None
    assert {r.config for r in store.records()} == {r.config for r in first.trials}

    # A second run measures nothing again: no profiling, no verification run.
    def boom(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr("autotune.tune._profile", boom)
    monkeypatch.setattr("autotune.verify._verifier.Verifier.record", boom)
    again = tune(path)
    assert again.config == first.config and again.measured == first.measured
    assert len(optuna.load_study(study_name="s", storage=f"sqlite:///{path}").trials) == 20


def test_more_trials_continue_the_study(tmp_path) -> None:
    path = str(tmp_path / "tune.db")
    tune(path)
    m = model()
    autotune.autotune(
        m,
        gpt_batch(m.config, 4),
        BUDGET_GB,
        device="cpu",
        global_batch_size=16,
        storage=path,
        study_name="s",
        n_trials=30,
    )
    assert len(optuna.load_study(study_name="s", storage=f"sqlite:///{path}").trials) == 30


def test_a_study_made_for_another_run_is_refused(tmp_path) -> None:
    path = str(tmp_path / "tune.db")
    tune(path)
    m = model()
    with pytest.raises(ConfigError, match=r"made for another tuning run \(budget_bytes differ\)"):
        autotune.autotune(
            m,
            gpt_batch(m.config, 4),
            2 * BUDGET_GB,
            device="cpu",
            global_batch_size=16,
            storage=path,
            study_name="s",
            n_trials=5,
        )


def test_storage_paths_pick_a_backend(tmp_path) -> None:
    assert resolve_storage("sqlite:///x.db") == "sqlite:///x.db"
    assert resolve_storage(str(tmp_path / "a.db")) == f"sqlite:///{tmp_path / 'a.db'}"
    assert isinstance(resolve_storage(str(tmp_path / "a.journal")), optuna.storages.JournalStorage)


WORKER = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    import autotune
    from autotune.models import gpt_batch, tiny_gpt
    m = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    r = autotune.autotune(m, gpt_batch(m.config, 4), {budget}, device="cpu", global_batch_size=16,
                          storage=sys.argv[1], study_name="shared", n_trials=20)
    print(r.config.describe())
""")


def test_two_processes_share_one_study(tmp_path) -> None:
    journal = str(tmp_path / "shared.journal")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(budget=BUDGET_GB))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), journal],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    study = optuna.load_study(study_name="shared", storage=resolve_storage(journal))
    assert len(study.trials) >= 20
    claims = {k: v for k, v in study.user_attrs.items() if k.startswith("claim:")}
    verified = [k for k in study.user_attrs if k.startswith("verified:")]
    # Every verification was claimed first, by one of the two workers.
    assert verified and len(claims) == len(verified)
    workers = set(claims.values())
    assert 1 <= len(workers) <= 2
    # A run afterwards sees every verification of both and picks the fastest of them all.
    records = [from_plain(autotune.TrialRecord, study.user_attrs[k]) for k in verified]
    final = tune(journal, study_name="shared")
    assert {r.config for r in final.trials} >= {r.config for r in records}
    best = max(r.measured.samples_per_s for r in final.trials if r.measured is not None)
    assert final.measured.samples_per_s >= 0.99 * best  # ties within 1%: the smaller peak


def test_optuna_prints_nothing_and_its_verbosity_comes_back(tmp_path, capfd) -> None:
    optuna.logging.set_verbosity(optuna.logging.INFO)  # what a user may have set
    try:
        StudyStore(resolve_storage(str(tmp_path / "s.db")), "quiet", {"k": 1})
        assert "A new study created" not in capfd.readouterr().err
        assert optuna.logging.get_verbosity() == optuna.logging.INFO
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_importing_autotune_sets_no_logging_state() -> None:
    code = textwrap.dedent(
        """
        import logging
        import autotune.tune, autotune.cli._main
        for name in ("", "autotune"):
            log = logging.getLogger(name)
            assert not log.handlers, (name, log.handlers)
        assert logging.getLogger("autotune").level == logging.NOTSET
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
