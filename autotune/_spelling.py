"""How a message spells an option: as the caller passes it.

The library's errors and warnings name what a Python caller passes (``budget_gb``,
``SearchSpace(optimizers=['adamw', 'adamw8bit'])``). A message marks each such name with
:func:`option`; the command line, while it runs (:func:`spelled_as`), has the same advice
name its flags (``--budget-gb``, ``--optimizers adamw,adamw8bit``). The names are keys,
not wording: a message can be reworded without the command line noticing, and
``tests/cli`` checks that every flag the command line spells is an option some message
marks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

__all__ = ["option", "spelled_as"]

_SPELLING: ContextVar[Mapping[str, str] | None] = ContextVar("autotune_spelling", default=None)


def option(python: str) -> str:
    """The option ``python`` (its Python spelling) as the caller spells it."""
    spelling = _SPELLING.get()
    return python if spelling is None else spelling.get(python, python)


@contextlib.contextmanager
def spelled_as(spelling: Mapping[str, str]) -> Iterator[None]:
    """Inside, messages spell each option of ``spelling`` (Python -> the caller's words)
    as it says."""
    token = _SPELLING.set(spelling)
    try:
        yield
    finally:
        _SPELLING.reset(token)
