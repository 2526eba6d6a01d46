"""``CountedOps``: the ops a piece of code dispatches, counted, compiled code running as
compiled under it. Shared by the tests that count what a step costs a device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNCS", "CountedOps"]

SYNCS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default})
"""The ops that read a value off the device (``item()``, ``bool()``): on a GPU each one
waits for every kernel queued before it."""


class CountedOps(TorchDispatchMode):
    """Counts the dispatched ops that ``which`` accepts (every op: ``None``)."""

    def __init__(self, which: Callable[[Any], bool] | None = None) -> None:
        super().__init__()
        self.which = which
        self.count = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code runs as compiled under it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += self.which is None or self.which(func)
        return func(*args, **(kwargs or {}))
