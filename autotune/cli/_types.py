"""Command-line values, checked where they are parsed: a bad one is one line, at once.

``--trials 0`` used to mean "the default" and ``--trials -5`` ran a search of nothing;
``--budget-gb 24GB`` was argparse's usage block. Each type here says what it wants.
"""

from __future__ import annotations

import argparse
import math
import re

from autotune.config import MAX_BATCH

__all__ = ["gib", "positive_int", "seconds"]

_UNITS = {"": 1.0, "g": 1.0, "gb": 1.0, "gib": 1.0, "m": 2**-10, "mb": 2**-10, "mib": 2**-10}
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
    """Device memory in GiB: ``24``, ``24GB``, ``24GiB`` or ``512MiB`` (GB means GiB, as
    ``nvidia-smi`` and torch report memory)."""
    match = _AMOUNT.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected GiB as 24, 24GB, 24GiB or 512MiB, got {text[:40]!r}"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a memory size above 0, got {text[:40]}")
    return value
