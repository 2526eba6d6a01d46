"""A tuning run's verification as one sequence, on a real profile and a real verifier: the
winner, the ladder below it, and what ``max_tuning_s`` leaves out."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from autotune.jobs import LocalJobs
from autotune.models import gpt_batch, tiny_gpt
from autotune.result import TuneResult
from autotune.space import SearchSpace
from autotune.tuning._data_parallel import Shortlist, shortlist
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem, make_problem
from autotune.tuning._profiling import profile_model
from autotune.verify import Verifier, verification


@pytest.fixture(scope="module")
def run() -> tuple[Any, Problem, Any, Shortlist]:
    """A 3-block GPT's profile and shortlist at a budget that keeps its largest
    micro-batch from fitting with every block kept: the ladder has somewhere to go."""
    model = tiny_gpt(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    sample = gpt_batch(model.config, 8)
    space = SearchSpace(precisions=("fp32",), optimizers=("sgd",), micro_batch_sizes=(1, 2, 4, 8))
    options = TuneOptions(budget_gb=0.0006, global_batch_size=8, device="cpu", space=space)
    problem = make_problem(model, sample, options)
    replica = copy.deepcopy(model)
    profile = profile_model(replica, problem)
    problem = problem.with_context(profile.context_bytes)
    return replica, problem, profile, shortlist(problem, profile, options, LocalJobs())


def _verify(
    run: tuple[Any, Problem, Any, Shortlist],
    plan: TuneResult | None = None,
    ends: float | None = None,
) -> Any:
    replica, problem, profile, searched = run
    verifier = Verifier.of(problem.workload(replica), problem.budget, 0, profile.written)
    return verification(
        verifier,
        searched.choosers,
        searched.candidates,
        LocalJobs(),
        plan=plan,
        started=None,
        eval_batch=None,
        largest_batch=problem.space.max_micro_batch_size,
        ends=ends,
    )


def test_the_winner_is_measured_and_every_rung_below_it_holds_less(run) -> None:
    verified = _verify(run)
    chosen = verified.chosen
    assert chosen.measured is not None and chosen.measured.peak_bytes <= run[1].budget
    assert chosen.config.eval_batch_size  # sized beside the winner's training state
    peaks = {r.config.replace(eval_batch_size=None): r.measured for r in verified.records}
    last = chosen.measured.peak_bytes
    assert verified.fallbacks  # the budget binds: there is a ladder
    for rung in verified.fallbacks:
        measured = peaks[rung.replace(eval_batch_size=None)]
        assert measured is not None and measured.peak_bytes < last
        assert rung.effective_batch_size == chosen.config.effective_batch_size
        last = measured.peak_bytes


def test_a_plan_is_verified_first_with_its_prediction_kept(run) -> None:
    _, problem, _, searched = run
    slow = searched.candidates[-1]  # the plan's config need not be the tuner's best
    plan = TuneResult(
        config=slow.config,
        predicted=slow.prediction.measurement,
        measured=None,
        budget_bytes=problem.budget,
        target=problem.target.info(),
        model=problem.model,
        breakdown=slow.prediction.breakdown,
    )
    verified = _verify(run, plan=plan)
    first = verified.records[0]
    assert first.config == plan.config and first.predicted == plan.predicted


def test_a_spent_time_budget_runs_the_first_candidate_and_names_the_rest(run) -> None:
    verified = _verify(run, ends=time.perf_counter())  # spent before it begins
    assert [r.config for r in verified.records] == [verified.chosen.config]
    assert verified.skipped  # what was not run, said
    assert verified.fallbacks == [] and verified.expert is None
