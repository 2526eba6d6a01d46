"""Tuning a table per sequence length: the fastest verified config at each length.

Activation memory grows with a batch's length, so a config tuned at the longest length
wastes the budget on every shorter batch. Each length of the table is tuned as a run of
its own (profile, search, verification under the budget) on the sample batch cut to that
length, the longest first. The rows keep the optimizer step's meaning (the global batch in
samples, or in tokens: ``tokens / length`` samples) and the longest row's precision and
optimizer, so training switches between rows with the same math and optimizer state. Where
the longest keeps the optimizer on the device, so do the others (a switch would move its
state through the host).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from autotune._spelling import option
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.result import LengthRow, Spent, TuneResult
from autotune.space import SearchSpace
from autotune.train import group_size, sequence_length, truncate
from autotune.tuning._attention_choice import tune_attentions
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import make_problem

__all__ = ["Lengths", "tune_lengths"]

log = logging.getLogger("autotune")


@dataclass(frozen=True)
class Lengths:
    """The lengths of a table and the samples of one optimizer step at each."""

    lengths: tuple[int, ...]
    """Ascending; the last is the longest."""
    samples: tuple[int, ...]
    """The global batch, in samples, at each length."""

    @staticmethod
    def of(
        sample: Any,
        lengths: Sequence[int] | None,
        global_batch_size: int | None,
        global_batch_tokens: int | None,
    ) -> Lengths:
        """Check the table's arguments (fast, before anything runs).

        Raises:
            ConfigError: what is wrong with them, and what to pass instead.
            BatchError: the sample batch has no sequence dimension.
        """
        full = sequence_length(sample)
        if lengths is None:
            lengths = (full,)
        ordered = tuple(sorted(set(lengths)))
        if ordered[-1] > full:
            raise ConfigError(
                f"the sample batch is {full} long but {option('sequence_lengths')} goes to "
                f"{ordered[-1]}: "
                "pass a sample batch at the longest length you will train on."
            )
        if global_batch_tokens is not None:
            uneven = [n for n in ordered if global_batch_tokens % n]
            if uneven:
                raise ConfigError(
                    f"{option('global_batch_tokens')} {global_batch_tokens} is not a whole "
                    "number of "
                    f"samples at length {uneven[0]}: use a multiple of every length."
                )
            samples = tuple(global_batch_tokens // n for n in ordered)
        elif global_batch_size is not None:
            samples = tuple(global_batch_size for _ in ordered)
        else:
            raise ConfigError(
                "a table per sequence length needs the optimizer step to mean the same at "
                f"every length: pass {option('global_batch_size')} (samples) or "
                f"{option('global_batch_tokens')}."
            )
        return Lengths(ordered, samples)


def tune_lengths(model: nn.Module, sample: Any, options: TuneOptions) -> TuneResult:
    """Tune each length of the table ``options`` asks for (the longest first) and join
    the rows into one result: the longest's, with ``by_length``.

    Raises:
        ConfigError: the table's lengths do not fit the sample or the step, or data
            parallelism was asked for (not supported yet).
        BatchError: the sample batch has no sequence dimension.
    """
    lengths = Lengths.of(
        sample, options.sequence_lengths, options.global_batch_size, options.global_batch_tokens
    )
    if options.parallel or group_size() > 1:
        raise ConfigError(
            f"{option('sequence_lengths')} and {option('global_batch_tokens')} are not "
            "supported with data parallelism yet; tune at the longest length with "
            f"{option('global_batch_size')}."
        )
    started = time.perf_counter()
    rows: list[LengthRow] = []
    results: list[TuneResult] = []
    row = options.replace(sequence_lengths=None, global_batch_tokens=None)
    for length, samples in reversed(list(zip(lengths.lengths, lengths.samples, strict=True))):
        log.info("tuning at sequence length %d (%d samples per step)", length, samples)
        row = row.replace(global_batch_size=samples)
        problem = make_problem(model, truncate(sample, length), row)
        result = tune_attentions(model, problem, row)
        if not results:  # the longest fixes the math of every row, and where the state lives
            row = row.replace(space=_as_tuned(row.space, result.config))
        results.append(result)
        rows.insert(
            0, LengthRow(length, result.config, result.predicted, result.measured, result.fallbacks)
        )
    return dataclasses.replace(
        results[0],
        by_length=tuple(rows),
        tuning_s=time.perf_counter() - started,
        spent=sum((r.spent for r in results), Spent()),
    )


def _as_tuned(space: SearchSpace, config: TrainConfig) -> SearchSpace:
    """``space`` with the precision and optimizer of ``config`` (the longest length's),
    and its optimizer on the device where that one's is."""
    return dataclasses.replace(
        space,
        precisions=(config.precision,),
        optimizers=(config.optimizer,),
        offload_optimizer=space.offload_optimizer if config.offload_optimizer else False,
    )
