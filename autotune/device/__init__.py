"""The device a run targets, in one place: the layer both ``measure`` and ``train`` stand on.

* ``_resolve``: devices in one normal form, decided where a device enters.
* ``_backend``: what autotune asks of a device beyond its tensors (caching allocator,
  streams, context), CUDA's through ``torch.cuda``, the CPU's as no-ops.
* ``_target``: the target's facts (name, memory, CUDA context, host RAM) and the budget
  in bytes.
* ``_host``: host memory that offload keeps on purpose, which device trackers leave out.
* ``_load``: what other work took of the machine's CPUs while a run measured.

The interface the other layers use is the table below (see :mod:`autotune._interface`);
each name loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface

if TYPE_CHECKING:
    from autotune.device._backend import Backend, backend_for, pinned_bytes
    from autotune.device._catalog import (
        CONTEXT_BYTES,
        DEVICES,
        INTER_NODE_BYTES_PER_S,
        MATMUL_EFFICIENCY,
        MEMORY_EFFICIENCY,
        RESERVE_SHARE,
        DeviceSpec,
        device_spec,
    )
    from autotune.device._host import (
        host_empty,
        host_memory,
        in_host_memory,
        is_host_storage,
        mark_host,
    )
    from autotune.device._load import CpuClock, busy, busy_note
    from autotune.device._resolve import resolve_device
    from autotune.device._target import Target, budget_bytes, discover, host_peak_bytes

INTERFACE = {
    "Backend": "autotune.device._backend",
    "CONTEXT_BYTES": "autotune.device._catalog",
    "CpuClock": "autotune.device._load",
    "DEVICES": "autotune.device._catalog",
    "DeviceSpec": "autotune.device._catalog",
    "INTER_NODE_BYTES_PER_S": "autotune.device._catalog",
    "MATMUL_EFFICIENCY": "autotune.device._catalog",
    "MEMORY_EFFICIENCY": "autotune.device._catalog",
    "RESERVE_SHARE": "autotune.device._catalog",
    "Target": "autotune.device._target",
    "backend_for": "autotune.device._backend",
    "budget_bytes": "autotune.device._target",
    "busy": "autotune.device._load",
    "busy_note": "autotune.device._load",
    "device_spec": "autotune.device._catalog",
    "discover": "autotune.device._target",
    "host_empty": "autotune.device._host",
    "host_peak_bytes": "autotune.device._target",
    "host_memory": "autotune.device._host",
    "in_host_memory": "autotune.device._host",
    "is_host_storage": "autotune.device._host",
    "mark_host": "autotune.device._host",
    "pinned_bytes": "autotune.device._backend",
    "resolve_device": "autotune.device._resolve",
}
"""What the other layers may import from here, by the private module that defines it."""

__all__ = [
    "CONTEXT_BYTES",
    "DEVICES",
    "INTER_NODE_BYTES_PER_S",
    "MATMUL_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "RESERVE_SHARE",
    "Backend",
    "CpuClock",
    "DeviceSpec",
    "Target",
    "backend_for",
    "budget_bytes",
    "busy",
    "busy_note",
    "device_spec",
    "discover",
    "host_empty",
    "host_memory",
    "host_peak_bytes",
    "in_host_memory",
    "is_host_storage",
    "mark_host",
    "pinned_bytes",
    "resolve_device",
]

__getattr__, __dir__ = interface(__name__, INTERFACE)
