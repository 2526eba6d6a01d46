"""Running the tuner for a benchmark row, and what it reports about itself.

The precisions and optimizers the tuner searched are read from its log line
``searching: N micro-batch sizes x fp32/bf16 x adamw`` (a precision it measured as much
slower than fp32 is dropped before the search, with a ``note:`` line saying so); the grid
uses the same ones.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

import autotune
from autotune.config import Timeline

from .budgets import Budget
from .cases import Case
from .report import Row, peak_errors, short

__all__ = ["Searched", "fill_tuning", "tune"]

_SEARCHING = re.compile(r"searching: \d+ micro-batch sizes x (\S+) x (\S+)")


@dataclass(frozen=True)
class Searched:
    """What the tuner searched, from its log."""

    precisions: list[str]
    optimizers: list[str]
    notes: list[str] = field(default_factory=list)


def tune(
    case: Case,
    model: torch.nn.Module,
    budget: Budget,
    device: torch.device,
    max_tuning_s: float | None = None,
) -> tuple[autotune.TuneResult, Searched]:
    """Run the tuner (within ``max_tuning_s`` where given); also return the precisions
    and optimizers it searched (from its log)."""
    with _tuner_log() as messages:
        result = autotune.autotune(
            model,
            case.sample(min(case.global_batch_size or 8, 8)),
            budget_gb=budget.gib,
            loss_fn=case.loss_fn,
            global_batch_size=case.global_batch_size,
            device=device,
            space=case.space,
            seed=0,
            max_tuning_s=max_tuning_s,
        )
    space = case.space or autotune.SearchSpace()
    precisions, optimizers = list(space.precisions), list(space.optimizers)
    for m in messages:
        if found := _SEARCHING.search(m):
            precisions, optimizers = found.group(1).split("/"), found.group(2).split("/")
    # The grid is eager: a compiled timeline's precision is searched there without it.
    precisions = list(dict.fromkeys(Timeline.named(p).precision for p in precisions))
    notes = [m.removeprefix("note: ") for m in messages if m.startswith("note:")]
    return result, Searched(precisions, optimizers, notes)


class _Collect(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _tuner_log() -> Iterator[list[str]]:
    """Collect the tuner's INFO messages (which precisions it searched, its notes)."""
    handler = _Collect(logging.INFO)
    logger = logging.getLogger("autotune")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def fill_tuning(row: Row, result: autotune.TuneResult, searched: Searched, n: int) -> None:
    """Record the tuned config, its peak errors and the tuner's notes in ``row``."""
    row.tuned = short(result.config, n)
    row.tuning_s = result.tuning_s
    row.searched = f"{'/'.join(searched.precisions)} x {'/'.join(searched.optimizers)}"
    row.peak_error_winner = (
        result.predicted.peak_bytes - result.measured.peak_bytes
    ) / result.measured.peak_bytes
    row.trial_errors, row.rejected_trials = peak_errors(result, n)
    row.violations += int(result.measured.peak_bytes > result.budget_bytes)
    row.details["tuned"] = {
        "predicted": result.predicted.__dict__,
        "measured": result.measured.__dict__,
        "fallbacks": [short(c, n) for c in result.fallbacks],
        "notes": searched.notes,
        "rejected": [
            f"{short(t.config, n)}: {t.error}" for t in result.trials if t.measured is None
        ],
    }
