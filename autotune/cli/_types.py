"""Command-line values, checked where they are parsed: a bad one is one line, at once.

``--trials 0`` used to mean "the default" and ``--trials -5`` ran a search of nothing;
``--budget-gb 24GB`` was argparse's usage block, and then meant 24 GiB. Each type here
says what it wants and means what it is given.

The options as the command line spells them: its flags, not the Python keywords.

The library marks each option its errors and warnings name (:func:`autotune._spelling.option`,
by its Python spelling); while a command runs, those messages name the flag instead.
A key here that no message marks is a flag the advice never names (``tests/cli`` checks).
"""

from __future__ import annotations

import argparse
import math
import re

from autotune.config import MAX_BATCH

__all__ = ["FLAGS", "gib", "positive_int", "seconds"]

_UNITS = {
    "": 1.0,
    "gib": 1.0,
    "mib": 2**-10,
    "gb": 1e9 / 2**30,
    "mb": 1e6 / 2**30,
}
"""GiB per unit: GiB and MiB are powers of two, GB and MB powers of ten; a bare number is
GiB, as ``budget_gb`` is in the API."""
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def positive_int(text: str) -> int:
    """A count from 1 up (trials, samples)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
    if not 1 <= value <= MAX_BATCH:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from 1 to {MAX_BATCH}, got {text[:40]}"
        )
    return value


def seconds(text: str) -> float:
    """A duration in seconds, above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text[:40]!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text[:40]}")
    return value


def gib(text: str) -> float:
    """Device memory in GiB: ``24`` or ``24GiB`` (2**30 bytes each), ``512MiB``, or in
    powers of ten ``24GB`` (10**9 bytes each) and ``500MB``: each spelling means exactly
    what it says."""
    match = _AMOUNT.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a memory size as 24 or 24GiB (GiB), 512MiB, 24GB or 500MB, got {text[:40]!r}"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a memory size above 0, got {text[:40]}")
    return value


FLAGS: dict[str, str] = {
    "loss_fn=lambda output, batch: ...": (
        "--loss FILE.py:NAME (NAME(output, batch) a function in a file of yours)"
    ),
    "SearchSpace(optimizers=['adamw', 'adamw8bit'])": "--optimizers adamw,adamw8bit",
    "optimizer=<that function> (or its import path as a string)": "--optimizer MODULE:FACTORY",
    "SearchSpace(offload_optimizer=True)": "--offload on",
    "SearchSpace(offload_optimizer=False)": "--offload off",
    "SearchSpace(offload_activations=True)": "--offload on",
    "SearchSpace(checkpointing=True)": "no --no-checkpointing",
    "SearchSpace(checkpointing=False)": "--no-checkpointing",
    "SearchSpace(selective_checkpointing=False)": "--no-selective-checkpointing",
    "SearchSpace(compile_blocks=True)": "--compile-blocks",
    "SearchSpace(blocks=[...])": "--blocks NAME,NAME",
    "SearchSpace.precisions": "--precisions",
    "SearchSpace.optimizers": "--optimizers",
    "SearchSpace.micro_batch_sizes": "--micro-batch-sizes",
    "global_batch_tokens": "--global-batch-tokens",
    "sequence_lengths": "--sequence-lengths",
    "global_batch_size": "--global-batch",
    "eval_batch_size": "--eval-batch",
    "max_tuning_s": "--max-tuning-time",
    "budget_gb": "--budget-gb",
    "budget_gb=24": "--budget-gb 24",
    "loss_fn": "--loss",
}
"""Each option by its Python spelling, as the command line's flag."""
