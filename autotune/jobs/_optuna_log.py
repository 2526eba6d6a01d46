"""Optuna's log kept quiet while autotune calls it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import optuna

__all__ = ["quiet_optuna"]


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna logs every trial and every study it creates at INFO on stderr; autotune's
    progress goes to the ``autotune`` logger only. Silenced while autotune calls Optuna,
    and the user's verbosity comes back after."""
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)
