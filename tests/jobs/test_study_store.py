"""Kept studies: resuming a tuning run, and two processes sharing one study."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import optuna
import pytest

import autotune
from autotune.errors import ConfigError
from autotune.jobs._job_store import job_key
from autotune.jobs._study_store import StudyStore, resolve_storage
from autotune.models import gpt_batch, tiny_gpt

BUDGET_GB = 48 / 1024
SPACE = autotune.SearchSpace(precisions=("fp32",), selective_checkpointing=False)


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
        space=SPACE,  # the study, not the knobs
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
    assert store.claims.result("profile") is not None
    # Each trial verified over a window of steps, or (a fallback) over one.
    for r in first.trials:
        kinds = ("verify", "verify-once")
        assert any(store.claims.result(job_key(k, r.config)) is not None for k in kinds)

    # A second run measures nothing again: no profiling, no verification run.
    def boom(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr("autotune.tuning._device_run.profile_model", boom)
    monkeypatch.setattr("autotune.verify._verifier.Verifier.record", boom)
    again = tune(path)
    assert again.config == first.config and again.measured == first.measured
    # The enumerated space is in the study once: one finished trial per setting that fits.
    trials = optuna.load_study(study_name="s", storage=f"sqlite:///{path}").trials
    assert trials and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({tuple(sorted(t.params.items())) for t in trials}) == len(trials)


def test_more_trials_continue_the_study(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("autotune.cost._search._EXACT_POINTS", 0)  # the Optuna study's way
    path = str(tmp_path / "tune.db")
    tune(path)
    assert len(optuna.load_study(study_name="s", storage=f"sqlite:///{path}").trials) == 20
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
        space=SPACE,
    )
    assert len(optuna.load_study(study_name="s", storage=f"sqlite:///{path}").trials) == 30


def test_a_study_made_for_another_run_is_refused(tmp_path) -> None:
    from autotune.tuning._device_run import job_store
    from autotune.tuning._options import TuneOptions
    from autotune.tuning._problem import make_problem

    path = str(tmp_path / "tune.db")
    m = model()
    first = TuneOptions(
        budget_gb=BUDGET_GB, device="cpu", global_batch_size=16, storage=path, study_name="s"
    )
    job_store(make_problem(m, gpt_batch(m.config, 4), first), first)  # a first run's study
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


def test_a_study_name_too_long_for_the_database_is_refused_up_front(tmp_path) -> None:
    # PostgreSQL holds 512 characters; the jobs' claims add up to 40 to the name.
    with pytest.raises(ConfigError, match=r"study name is 500 characters long; at most 472"):
        StudyStore(resolve_storage(str(tmp_path / "s.db")), "x" * 500, {"k": 1})
    assert StudyStore(resolve_storage(str(tmp_path / "s.db")), "x" * 472, {"k": 1})


def test_storage_paths_pick_a_backend(tmp_path) -> None:
    assert resolve_storage("sqlite:///x.db") == "sqlite:///x.db"
    assert resolve_storage(str(tmp_path / "a.db")) == f"sqlite:///{tmp_path / 'a.db'}"
    assert isinstance(resolve_storage(str(tmp_path / "a.journal")), optuna.storages.JournalStorage)


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
        import autotune.tuning._autotune, autotune.cli._main
        for name in ("", "autotune"):
            log = logging.getLogger(name)
            assert not log.handlers, (name, log.handlers)
        assert logging.getLogger("autotune").level == logging.NOTSET
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
