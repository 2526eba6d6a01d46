"""How a subpackage shows the others what they may use: its interface.

Each subpackage's ``__init__`` is its interface: a table of the names the rest of the
package may import from it (``from autotune.measure import Profiler``), each with the
private module that defines it. A name is loaded on first use, with its module only, so
that importing one name of a layer loads no more of it than that name needs (``prepare``
loads no tuner; the cost model no training code). Inside a subpackage, modules import
their siblings' private modules directly; from outside, only through the interface
(``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["interface"]


def interface(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__``: each of ``names``
    loaded from its module (``names[name]``) when it is first asked for."""

    def get(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups find it directly
        return value

    def listing() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return get, listing
