"""How the package loads its public names that need torch: on first use.

``import autotune`` loads no torch and no optuna: the records (``TrainConfig``,
``TuneResult``, the errors) are imported at once, and every other public name is loaded
with its module when it is first asked for (``autotune.prepare`` loads no tuner). Those
names are the ones the package's ``if TYPE_CHECKING:`` block imports, which type
checkers read as plain imports; the block is the one table, read here from the source.
The subpackages import their names plainly (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["lazy_names", "typing_imports"]


def typing_imports(source: str) -> dict[str, str]:
    """The names a module's ``if TYPE_CHECKING:`` block imports, by the module each
    comes from."""
    return {
        alias.asname or alias.name: node.module
        for guard in ast.parse(source).body
        if isinstance(guard, ast.If) and getattr(guard.test, "id", None) == "TYPE_CHECKING"
        for node in guard.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def lazy_names(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__``: each name its typing
    block imports, loaded from its module when it is first asked for (the block is read
    then, not when the package is imported)."""

    @functools.cache
    def names() -> dict[str, str]:
        path = sys.modules[package].__file__
        assert path is not None
        return typing_imports(Path(path).read_text(encoding="utf-8"))

    def get(name: str) -> Any:
        if name not in names():
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names()[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups find it directly
        return value

    def listing() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names()))

    return get, listing
