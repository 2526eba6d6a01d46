"""The search on a fixed profile: exact enumeration of a small space, the Optuna study of a
large one (forced here with ``exact_limit=0``), constraints, determinism, storage."""

from __future__ import annotations

import dataclasses

import pytest

from autotune._profile_data import Profile, TimeCurve
from autotune.config import Timeline
from autotune.cost._candidates import best_config, enumerate_candidates, largest_fitting
from autotune.cost._chooser import Chooser
from autotune.cost._cost_model import CostModel
from autotune.cost._knobs import Knobs
from autotune.cost._search import search

# bf16 per-sample cost falls faster with size than fp32's; checkpointing costs 30%.
CURVES = {
    "fp32": TimeCurve((1, 4, 16, 64), (0.010, 0.030, 0.100, 0.380), (2, 64), (0.3, 0.3)),
    "bf16": TimeCurve((1, 4, 16, 64), (0.012, 0.030, 0.080, 0.280), (2, 64), (0.3, 0.3)),
}


@pytest.fixture(scope="module")
def cost(gpt_profile: Profile) -> CostModel:
    timed = {
        p: dataclasses.replace(pp, time=CURVES[str(p)]) for p, pp in gpt_profile.precisions.items()
    }
    return CostModel(dataclasses.replace(gpt_profile, precisions=timed))


def study(cost: CostModel, limit_fraction: float, global_batch: int | None = 64) -> Chooser:
    sizes = [b for b in range(1, 65) if global_batch is None or global_batch % b == 0]
    none = (False,) * cost.n_blocks
    top = cost.peak_of(Knobs.given("fp32", "adamw", 64, 1, none))
    return Chooser(
        cost=cost,
        sizes=sizes,
        timelines=(Timeline("fp32"), Timeline("bf16")),
        optimizers=("adamw",),
        global_batch_size=global_batch,
        limit=int(top * limit_fraction),
    )


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.8])
def test_candidates_fit_and_keep_the_global_batch(cost: CostModel, fraction: float) -> None:
    s = study(cost, fraction)
    found = search(s, n_trials=40, timeout_s=None, seed=0)
    assert found
    for c in found:
        assert c.prediction.measurement.peak_bytes <= s.limit
        assert c.config.effective_batch_size == 64
    speeds = [c.prediction.measurement.samples_per_s for c in found]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.8])
def test_a_small_space_is_enumerated_exactly(cost: CostModel, fraction: float) -> None:
    s = study(cost, fraction)
    found = search(s, n_trials=5, timeout_s=None, seed=0)  # n_trials does not cut it short
    assert [c.config for c in found] == [c.config for c in enumerate_candidates(s)]
    best = best_config(s)
    assert best is not None and found[0].config == best.config
    # every fitting setting is there, once
    keys = {(c.config.micro_batch_size, c.config.timeline) for c in found}
    assert len(keys) == len(found)
    fitting = [(b, p) for p in s.timelines for b in s.sizes if s.config(p, "adamw", b)]
    assert keys == set(fitting)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.8])
def test_the_optuna_study_finds_the_enumerated_optimum(cost: CostModel, fraction: float) -> None:
    s = study(cost, fraction)
    best = best_config(s)
    found = search(s, n_trials=40, timeout_s=None, seed=0, exact_limit=0)
    assert best is not None
    got = found[0].prediction.measurement.samples_per_s
    assert got >= 0.99 * best.prediction.measurement.samples_per_s


def test_study_without_global_batch_searches_sizes(cost: CostModel) -> None:
    s = study(cost, 0.5, global_batch=None)
    found = search(s, n_trials=60, timeout_s=None, seed=0, exact_limit=0)
    assert all(c.config.grad_accum_steps == 1 for c in found)
    best = best_config(s)
    assert best is not None
    assert (
        found[0].prediction.measurement.samples_per_s
        >= 0.97 * best.prediction.measurement.samples_per_s
    )


def test_the_study_keeps_the_sizes_it_planned_not_the_ones_it_drew(cost: CostModel) -> None:
    """With a few allowed sizes and no global batch, a drawn size is snapped to the
    nearest allowed one; the trial is harvested by the size planned."""
    s = dataclasses.replace(study(cost, 0.5, global_batch=None), sizes=(3, 5, 12, 40))
    found = search(s, n_trials=30, timeout_s=None, seed=0, exact_limit=0)
    exact = enumerate_candidates(s)
    assert {c.config for c in found} == {c.config for c in exact}


def test_seeded_studies_agree(cost: CostModel) -> None:
    a = search(study(cost, 0.4), n_trials=30, timeout_s=None, seed=7, exact_limit=0)
    b = search(study(cost, 0.4), n_trials=30, timeout_s=None, seed=7, exact_limit=0)
    assert [c.config for c in a] == [c.config for c in b]


def test_tight_budget_prefers_checkpointing_or_bf16(cost: CostModel) -> None:
    s = study(cost, 0.3)
    winner = search(s, n_trials=40, timeout_s=None, seed=0)[0].config
    unconstrained = search(study(cost, 10.0), n_trials=40, timeout_s=None, seed=0)[0].config
    assert winner != unconstrained
    assert (
        winner.checkpoint
        or winner.precision == "bf16"
        or winner.micro_batch_size < unconstrained.micro_batch_size
    )


def test_largest_fitting_is_monotone_in_the_limit(cost: CostModel) -> None:
    sizes = [largest_fitting(study(cost, f), Timeline("fp32"), "adamw") for f in (0.2, 0.4, 0.8)]
    assert all(s is not None for s in sizes)
    assert sizes == sorted(sizes)


def test_no_checkpointing_space_never_checkpoints(cost: CostModel) -> None:
    s = dataclasses.replace(study(cost, 0.5), checkpointing=False)
    assert all(not c.config.checkpoint for c in search(s, n_trials=30, timeout_s=None, seed=0))


def test_storage_keeps_the_study_and_n_trials_counts_its_trials(cost: CostModel, tmp_path) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'study.db'}"
    kw = {"timeout_s": None, "seed": 0, "storage": url, "study_name": "s", "exact_limit": 0}
    first = search(study(cost, 0.5), n_trials=12, **kw)
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 12
    # Resuming with the same n_trials runs nothing more, and finds the same candidates.
    again = search(study(cost, 0.5), n_trials=12, **kw)
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 12
    assert [c.config for c in again] == [c.config for c in first]
    search(study(cost, 0.5), n_trials=17, **kw)
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 17


def test_an_enumerated_space_is_kept_in_the_study_once(cost: CostModel, tmp_path) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'study.db'}"
    kw = {"n_trials": None, "timeout_s": None, "seed": 0, "storage": url, "study_name": "s"}
    found = search(study(cost, 0.5), **kw)
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert len(trials) == len(found)  # one finished trial per candidate, for the dashboard
    best = max(trials, key=lambda t: t.value or 0.0)
    assert best.params["micro_batch_size"] == found[0].config.micro_batch_size
    assert best.value == found[0].prediction.measurement.samples_per_s
    search(study(cost, 0.5), **kw)  # resumed: nothing added
    assert len(optuna.load_study(study_name="s", storage=url).trials) == len(found)
