"""Host memory that offload keeps on purpose: pinned activation copies, host optimizer state.

It is not device memory. On CUDA a device tracker never sees it; on CPU, where the host is
the device, offload allocates it inside :func:`host_memory` (or declares it with
:func:`mark_host`) and the live-bytes tracker leaves it out, so that offload's accounting
can be tested without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch

__all__ = ["host_empty", "host_memory", "in_host_memory", "is_host_storage", "mark_host"]

_HOST = threading.local()
_HOST_STORAGES: dict[int, int] = {}  # id(storage) -> data_ptr, while the storage lives


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Storages allocated inside are host memory, not device memory: trackers skip them."""
    _HOST.depth = getattr(_HOST, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST.depth -= 1


def mark_host(tensors: Iterable[torch.Tensor]) -> None:
    """Declare the storages of ``tensors`` host memory (e.g. a host optimizer's state)."""
    for t in tensors:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in _HOST_STORAGES:
            _HOST_STORAGES[key] = storage.data_ptr()
            weakref.finalize(storage, _HOST_STORAGES.pop, key, None)


def in_host_memory() -> bool:
    """Whether this thread is inside :func:`host_memory`."""
    return getattr(_HOST, "depth", 0) > 0


def is_host_storage(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` was declared host memory with :func:`mark_host`."""
    return id(storage) in _HOST_STORAGES


def host_empty(like: torch.Tensor, *, pinned: bool) -> torch.Tensor:
    """An empty contiguous host tensor shaped like ``like`` (pinned for CUDA transfers)."""
    with host_memory():
        out = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
    mark_host((out,))
    return out
