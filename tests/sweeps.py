"""A sweep's cases in the tests: the representative ones run by CI, the rest marked
``sweep`` (run with ``python -m pytest -m sweep``; see benchmarks/README.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

SWEEP = pytest.mark.sweep
"""A case beyond a sweep's representative one (not run by CI)."""


def sweep(cases: Iterable[Any], representative: Iterable[Any]) -> list[Any]:
    """``cases`` as parameters (a tuple: one value per argument name), each not in
    ``representative`` marked ``sweep``."""
    kept = list(representative)
    return [
        c if c in kept else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=SWEEP)
        for c in cases
    ]
