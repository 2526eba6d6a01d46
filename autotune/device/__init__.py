"""The device a run targets, in one place: the layer both ``measure`` and ``train`` stand on.

* ``_resolve``: devices in one normal form, decided where a device enters.
* ``_backend``: what autotune asks of a device beyond its tensors (caching allocator,
  streams, context), CUDA's through ``torch.cuda``, the CPU's as no-ops; and the host
  memory that offload keeps on purpose, which device trackers leave out.
* ``_target``: the target's facts (name, memory, CUDA context, host RAM) and the budget
  in bytes.
* ``_load``: what other work took of the machine's CPUs while a run measured.
* ``_caching_allocator``: the CUDA caching allocator's rules, modelled: what it reserves
  for a sequence of requests; ``_allocator_trace``: its recorded traces and requests,
  replayed through the model.

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.device._allocator_trace import RequestLog, relaid, reserved_beyond
from autotune.device._backend import (
    Backend,
    RequestBox,
    backend_for,
    host_empty,
    host_memory,
    in_host_memory,
    is_host_storage,
    mark_host,
    pinned_bytes,
)
from autotune.device._caching_allocator import AllocatorSettings
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
from autotune.device._load import CpuClock, busy, busy_note
from autotune.device._resolve import resolve_device
from autotune.device._target import Target, budget_bytes, discover, host_peak_bytes

__all__ = [
    "CONTEXT_BYTES",
    "DEVICES",
    "INTER_NODE_BYTES_PER_S",
    "MATMUL_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "RESERVE_SHARE",
    "AllocatorSettings",
    "Backend",
    "CpuClock",
    "DeviceSpec",
    "RequestBox",
    "RequestLog",
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
    "relaid",
    "reserved_beyond",
    "resolve_device",
]
