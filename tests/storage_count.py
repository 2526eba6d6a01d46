"""An independent count of a process's live tensor storage, to check autotune's own.

:class:`StorageCount` is a dispatch mode that keeps a weak reference to every storage an
op receives or returns (a DTensor's by its local shard) and, around every op, adds up the
bytes each of them holds at that moment. It shares nothing with autotune's tracker: it
does not tell allocations from inputs, is told of no state, and reads every storage's
size again at every op, so a storage resized outside any op (FSDP2's gathered
parameters) counts what it holds. It is slow (every storage seen, at every op): a few
steps of a small model.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StorageCount"]


class StorageCount(TorchDispatchMode):
    """The peak bytes of the storages alive in the block, on ``device_type``.

    Args:
        alive: Tensors alive when the block begins that count from its start (a step's
            state and batch); any other tensor counts once an op has seen it.
        device_type: The device whose storages count.
    """

    def __init__(self, alive: Iterable[torch.Tensor] = (), device_type: str = "cpu") -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self._seen: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        for t in alive:
            self._see(t)
        self.peak = self.live()

    def live(self) -> int:
        """The bytes every storage seen and still alive holds now."""
        total = 0
        for key, ref in list(self._seen.items()):
            storage = ref()
            if storage is None:
                del self._seen[key]
            else:
                total += storage.nbytes()
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in tree_flatten((args, kwargs))[0]:
            self._see(t)
        self.peak = max(self.peak, self.live())
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._see(t)
        self.peak = max(self.peak, self.live())
        return out

    def _see(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = getattr(t, "_local_tensor", t)  # a DTensor's shard on this process
        if local.device.type != self.device_type or local.layout != torch.strided:
            return
        storage = local.untyped_storage()
        ref = self._seen.get(id(storage))
        if ref is None or ref() is None:  # new, or a dead one's id taken again
            self._seen[id(storage)] = weakref.ref(storage)
