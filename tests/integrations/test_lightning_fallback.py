"""The ``Autotune`` callback's fallback ladder, on a real out-of-memory error in Lightning."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import G, fresh, gpt2, samples, stack
from test_lightning import LR, STEPS, LitGPT, trainer_with

import autotune
from autotune import SearchSpace, TrainConfig, TuneResult
from autotune.errors import AutotuneWarning, ConfigError
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.result import ModelInfo
from autotune.train._identity import fingerprint

pl = pytest.importorskip("lightning.pytorch")
from autotune.integrations.lightning import Autotune  # noqa: E402


def peak_of(result: TuneResult, config: TrainConfig) -> int:
    """The peak verification measured for ``config``."""
    return next(r.measured.peak_bytes for r in result.trials if r.config == config and r.measured)


class Squeeze(pl.Callback):
    """From the second batch of the second optimizer step on, a budget guard that the
    tuned winner breaks: it runs out of memory in the middle of a step. The guard holds
    to the end (another error would fail the fit); ``reading`` is the peak after the
    batch that failed, the first one it ran whole."""

    def __init__(self, tuner: Autotune, budget: Callable[[TuneResult], int]) -> None:
        self.tuner = tuner
        self.budget_of = budget
        self.tracker = LiveBytesTracker("cpu")
        self.stack = contextlib.ExitStack()
        self.reading: Any = None
        self.budget = 0
        self.trained_with: TrainConfig | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.tuner.result is not None
        self.budget = self.budget_of(self.tuner.result)
        existing = state_tensors(pl_module, *trainer.optimizers)
        peak = measure_peak(torch.device("cpu"), existing=existing, tracker=self.tracker)
        self.reading = self.stack.enter_context(peak)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx == trainer.accumulate_grad_batches + 1:
            self.tracker.budget_bytes = self.budget

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, idx: int) -> None:
        if idx == trainer.accumulate_grad_batches + 1:  # the peak after the failed attempt
            self.tracker.peak = self.tracker.live

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        assert self.tuner.handle is not None
        self.trained_with = self.tuner.handle.config
        self.stack.close()


def inner(c: TrainConfig) -> TrainConfig:
    """``c`` for the module's inner model, whose blocks are named without ``model.``."""
    return c.replace(checkpoint=tuple(n.removeprefix("model.") for n in c.checkpoint))


def fit_squeezed(tuner: Autotune, budget: Callable[[TuneResult], int]) -> tuple[Any, Squeeze]:
    """Fit a fresh module under the squeeze; check the warning, the steps, the peak after
    the fallback, and that the trainer and the module have their own methods back."""
    module = LitGPT()
    start = fresh(module.model)
    squeeze = Squeeze(tuner, budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_with(tuner, squeeze).fit(module)
    ours = [str(w.message) for w in caught if issubclass(w.category, AutotuneWarning)]
    assert len(ours) == 1 and "the step's 2 batches run again with fallback" in ours[0], "\n".join(
        ours
    )
    assert module.trainer.global_step == STEPS
    assert squeeze.reading.peak_bytes <= squeeze.budget
    assert tuner.ladder is None and "training_step" not in vars(module)
    assert "batch_to_device" not in vars(module.trainer.strategy)
    assert "run" not in vars(module.trainer.fit_loop.epoch_loop.automatic_optimization)
    return (module, start), squeeze


def assert_runner_equal(modules: Any, first: TrainConfig, then: TrainConfig) -> None:
    """The weights equal, bit for bit, those of a Runner that ran ``first`` for one step
    and ``then`` after, on the same batches: the failed attempt left nothing behind."""
    module, start = modules
    data = samples(STEPS * G, seed=1)
    runner = autotune.prepare(start, inner(first), lr=LR)
    runner.step(stack(data[:G]))
    runner.switch(inner(then))
    for i in range(1, STEPS):
        runner.step(stack(data[i * G : (i + 1) * G]))
    runner.close()
    for a, b in zip(module.model.parameters(), start.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_tuned_step_that_runs_out_of_memory_falls_back_and_runs_again(
    tuned: TuneResult,
) -> None:
    space = SearchSpace(precisions=("fp32",), micro_batch_sizes=(2, 4))
    tuner = Autotune(tuned.budget_bytes / 2**30, global_batch_size=G, space=space, n_trials=20)

    def between(r: TuneResult) -> int:  # under the winner's peak, over the first fallback's
        # (the first fallback taken: over the last one's only, a ladder of three, which
        # timing decides, would run out of memory twice)
        return (peak_of(r, r.config) + peak_of(r, r.fallbacks[0])) // 2

    modules, squeeze = fit_squeezed(tuner, between)
    result, used = tuner.result, squeeze.trained_with
    assert result is not None and used is not None
    assert squeeze.budget < peak_of(result, result.config)
    # A fallback, as the dataloader's batches allow (whole when the fallback's are larger).
    m = result.config.micro_batch_size
    assert any(used == f or used == f.replace(micro_batch_size=m, grad_accum_steps=G // m)
               for f in result.fallbacks)  # fmt: skip
    assert_runner_equal(modules, result.config, used)


def test_a_smaller_fallback_micro_batch_splits_each_batch_inside_training_step(
    tuned: TuneResult,
) -> None:
    blocks = tuple(f"model.{b}" for b in tuned.model.blocks)
    fast = TrainConfig(micro_batch_size=4, grad_accum_steps=2, optimizer="sgd")
    frugal = TrainConfig(micro_batch_size=2, grad_accum_steps=4, optimizer="sgd", checkpoint=blocks)
    lit = LitGPT()  # the result describes the module it is applied to
    info = ModelInfo("LitGPT", fingerprint(lit), tuned.model.n_parameters, blocks)
    given = dataclasses.replace(tuned, config=fast, fallbacks=(frugal,), model=info)
    model, sample = gpt2(), stack(samples(G))
    peaks = [autotune.estimate(model, sample, inner(c))[0] for c in (fast, frugal)]
    assert peaks[1] < peaks[0]

    tuner = Autotune.from_result(given)
    modules, squeeze = fit_squeezed(tuner, lambda r: sum(peaks) // 2)
    assert tuner.result is given and squeeze.trained_with == frugal
    assert modules[0].batch_size == 4  # the dataloader kept its batches; each split in two
    assert_runner_equal(modules, fast, frugal)


def test_from_result_refuses_a_result_for_another_optimizer(tuned: TuneResult) -> None:
    given = dataclasses.replace(tuned, config=tuned.config.replace(optimizer="adamw"))
    with pytest.raises(ConfigError, match=r"own optimizer on the device \(sgd\)"):
        trainer_with(Autotune.from_result(given)).fit(LitGPT())
