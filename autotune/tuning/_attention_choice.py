"""Tuning the attention implementation: each one a tuning run of its own on the model set
to it, the fastest verified winner of them all wins.

The implementations compute the same attention (within the dtype's tolerance) but differ
in memory (eager keeps the attention matrix for backward) and speed, which depend on the
device, the dtype and the length: measured, never assumed. The user's model is set to
each in turn and put back as it was; every config of the result names its implementation,
which ``prepare()`` sets.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from autotune.config import TrainConfig
from autotune.errors import BatchError, BudgetTooSmallError, ProfileError, VerificationError
from autotune.result import Spent, TuneResult
from autotune.train import set_attention
from autotune.tuning._device_run import tune_on_device
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem

__all__ = ["tune_attentions"]

log = logging.getLogger("autotune")


def tune_attentions(model: nn.Module, problem: Problem, options: TuneOptions) -> TuneResult:
    """One tuning run per implementation of ``options.space.attention`` (one with the
    model's own where it names none); the fastest verified result, with every run's
    trials and seconds.

    Raises:
        ConfigError: the model has no implementation to choose, or one is not installed.
        BudgetTooSmallError, BatchError, ProfileError, VerificationError: no
            implementation fits or runs (the first's error).
    """
    if not options.space.attention:
        return tune_on_device(model, problem, options)
    results: list[TuneResult] = []
    failed: list[Exception] = []
    for name in options.space.attention:
        put_back = set_attention(model, name)
        try:
            log.info("tuning with attention %s", name)
            result = tune_on_device(model, problem, options)
        except (BudgetTooSmallError, BatchError, ProfileError, VerificationError) as exc:
            log.info("attention %s: %s", name, str(exc).splitlines()[0])
            failed.append(exc)
            continue
        finally:
            put_back()
        results.append(_named(result, name))
    if not results:
        raise failed[0]
    best = max(results, key=lambda r: (r.measured or r.predicted).samples_per_s)
    return dataclasses.replace(
        best,
        trials=tuple(t for r in results for t in r.trials),
        tuning_s=sum(r.tuning_s for r in results),
        spent=sum((r.spent for r in results), Spent()),
    )


def _named(result: TuneResult, name: str) -> TuneResult:
    """``result`` with every config naming attention implementation ``name``."""

    def named(c: TrainConfig) -> TrainConfig:
        return c.replace(attention=name)

    return dataclasses.replace(
        result,
        config=named(result.config),
        fallbacks=tuple(named(f) for f in result.fallbacks),
        trials=tuple(dataclasses.replace(t, config=named(t.config)) for t in result.trials),
    )
