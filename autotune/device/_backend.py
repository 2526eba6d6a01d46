"""What autotune asks of a device beyond its tensors, in one place.

A device with a caching allocator (CUDA) reserves more than its live tensors hold, keeps
what it reserved, can be capped, and runs asynchronously on streams; the CPU has none of
this: its peak is the live-bytes tracker's, its copies are synchronous, and every call
here is a no-op. autotune calls a :class:`Backend` instead of ``torch.cuda``, so that CI
runs the CUDA logic against a CPU stand-in with the same statistics and streams that run
in order (``tests/simulated_cuda.py``).

Host memory that offload keeps on purpose: pinned activation copies, host optimizer state.

It is not device memory. On CUDA a device tracker never sees it; on CPU, where the host is
the device, offload allocates it inside :func:`host_memory` (or declares it with
:func:`mark_host`) and the live-bytes tracker leaves it out, so that offload's accounting
can be tested without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from autotune._format import GIB
from autotune.device._allocator_trace import RequestLog, recorded, request_log

__all__ = [
    "Backend",
    "CudaBackend",
    "RequestBox",
    "backend_for",
    "context_bytes",
    "host_empty",
    "host_memory",
    "in_host_memory",
    "is_host_storage",
    "mark_host",
    "pinned_bytes",
]

_NATIVE = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
"""The x86 CPU flags (as ``torch.cpu.get_capabilities()`` names them) of instructions that
compute in each half precision."""


class Backend:
    """The CPU: no caching allocator, nothing asynchronous, nothing to cap."""

    caching = False
    """Whether a caching allocator reserves device memory beyond the live tensors."""
    streams = False
    """Whether copies can run on side streams, overlapping compute (else synchronous)."""
    pins = False
    """Whether host buffers for transfers are pinned (page-locked)."""
    rounds_host = False
    """Whether host buffers for transfers take what torch's pinned allocator takes (each
    rounded up to a power of two)."""
    host_is_device = True
    """Whether host memory is this device's memory (the CPU): then offload saves nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def available(self) -> bool:
        """Whether this process can use the device."""
        return True

    def start(self) -> None:
        """Create the device's context, so that its size and free memory can be read."""

    def name(self) -> str:
        """The device's model name."""
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or "CPU"

    def supports_bf16(self) -> bool:
        """Whether bf16 autocast runs here."""
        return True

    def emulates(self, precision: str) -> bool:
        """Whether the device has no arithmetic of its own for ``precision``'s
        half-precision type (it converts to fp32 and back: several times slower than
        fp32, not worth timing). An x86 CPU computes bf16 with AVX-512 BF16 or AMX, fp16
        with AVX-512 FP16 or AMX-FP16; of another CPU nothing is known (``False``: timed)."""
        flags = _NATIVE.get(precision)
        caps = torch.cpu.get_capabilities()
        if flags is None or caps.get("architecture") != "x86_64":
            return False
        return not any(caps.get(f, False) for f in flags)

    def free(self) -> int:
        """Device memory free now, to this process and others (0: no memory of its own)."""
        return 0

    def rng_state(self) -> Any:
        """The device's random state, to put back with :meth:`set_rng_state` (or ``None``)."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Put back a state from :meth:`rng_state`."""

    def synchronize(self) -> None:
        """Wait for the device's queued work."""

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the device."""

    def empty_host_cache(self) -> None:
        """Return cached, unused pinned host memory to the host (offload's buffers)."""

    def host_bytes(self, nbytes: int) -> int:
        """Host bytes a transfer buffer of ``nbytes`` takes (see :attr:`rounds_host`)."""
        return pinned_bytes(nbytes) if self.rounds_host else nbytes

    def reset_peak(self) -> None:
        """Start a new peak of :meth:`max_reserved`."""

    def reserved(self) -> int:
        """Bytes the allocator holds now (0 without a caching allocator)."""
        return 0

    def max_reserved(self) -> int:
        """Bytes the allocator held at most since :meth:`reset_peak`."""
        return 0

    def foreign_bytes(self) -> int:
        """What the allocator holds for tensors outside a run about to start: its reserved
        bytes once its unused cached blocks are returned. A cache that earlier work left
        is the run's to reuse; counted as foreign, the run's own growth into it would be
        missed (every peak is read as reserved less this)."""
        self.empty_cache()
        return self.reserved()

    def total(self) -> int:
        """The device's memory (0 when it has no memory of its own)."""
        return 0

    def context_bytes(self) -> int:
        """This process's device memory outside the allocator (the CUDA context, cuBLAS
        handles, loaded kernels); it grows as kernels load, so read it after a step."""
        return 0

    @contextlib.contextmanager
    def cap(self, nbytes: int | None) -> Iterator[None]:
        """Let the allocator reserve at most ``nbytes`` inside (``None``: no cap); the
        cap in force before is restored after."""
        yield

    def capped(self) -> bool:
        """Whether a cap below the device's memory is in force."""
        return False

    def lifted(self) -> contextlib.AbstractContextManager[None]:
        """Lift the cap in force to the device's whole memory inside (what no budget
        holds); the cap comes back after."""
        return self.cap(self.total()) if self.capped() else contextlib.nullcontext()

    def new_stream(self) -> Any:
        """A side stream (only where :attr:`streams`)."""
        raise NotImplementedError("this device has no streams")

    def current_stream(self) -> Any:
        """The stream the compute runs on (only where :attr:`streams`)."""
        raise NotImplementedError("this device has no streams")

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Run the block's work on ``stream``."""
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s queued work is done."""

    @contextlib.contextmanager
    def requests(self) -> Iterator[RequestBox]:
        """The caching allocator's requests in the block (its ``log``, once the block is
        over; ``None`` without a caching allocator, or where it cannot be recorded)."""
        yield RequestBox()


class RequestBox:
    """Filled in when :meth:`Backend.requests` is over; :meth:`cut` marks where a stretch
    of the block begins."""

    log: RequestLog | None = None

    def __init__(self, position: Callable[[], int] | None = None) -> None:
        self._position = position
        self.cuts: list[int] = []

    def cut(self) -> None:
        """Mark that a stretch begins here (a micro-batch, the optimizer step)."""
        if self._position is not None:
            self.cuts.append(self._position())


class CudaBackend(Backend):
    """The CUDA caching allocator and streams, through ``torch.cuda``."""

    caching = True
    streams = True
    pins = True
    rounds_host = True
    host_is_device = False

    def available(self) -> bool:
        return torch.cuda.is_available()

    def start(self) -> None:
        torch.cuda.init()
        torch.empty(1, device=self.device)  # the context exists once a tensor does

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def supports_bf16(self) -> bool:
        return bool(torch.cuda.is_bf16_supported())

    def emulates(self, precision: str) -> bool:
        return False  # every CUDA GPU computes fp16; bf16 where supports_bf16 says

    def free(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def rng_state(self) -> Any:
        return torch.cuda.get_rng_state_all()

    def set_rng_state(self, state: Any) -> None:
        torch.cuda.set_rng_state_all(state)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def empty_host_cache(self) -> None:
        # torch's pinned-memory cache keeps what offload freed (rounded up to powers of
        # two) for the life of the process unless asked; torch >= 2.8 can be asked.
        release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if release is not None:
            release()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def requests(self) -> Iterator[RequestBox]:
        def counted() -> int:  # allocations and completed frees so far
            stats = torch.cuda.memory_stats(self.device)
            return int(
                stats.get("allocation.all.allocated", 0) + stats.get("allocation.all.freed", 0)
            )

        with recorded(self.device) as out:
            begun = counted()
            box = RequestBox(lambda: counted() - begun)
            yield box
        if out.trace is not None:
            box.log = request_log(out.trace, box.cuts)

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def max_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def total(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def context_bytes(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", ""))
        try:
            import pynvml
        except ImportError:
            pynvml = None
        return context_bytes(pynvml, uuid, os.getpid(), self.reserved(), total - free)

    def _index(self) -> int:
        # The memory fraction takes an index ("cuda" alone raises in torch 2.11).
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _fraction(self) -> float:
        # torch >= 2.7 can say what is set; older ones only that 1.0 is the default.
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return float(getter(self._index())) if getter is not None else 1.0

    def capped(self) -> bool:
        return self._fraction() < 1.0

    @contextlib.contextmanager
    def cap(self, nbytes: int | None) -> Iterator[None]:
        if nbytes is None:
            yield
            return
        index, previous = self._index(), self._fraction()
        fraction = min(max(nbytes / self.total(), 0.0), 1.0)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, index)


def pinned_bytes(nbytes: int) -> int:
    """Host bytes torch's caching pinned-memory allocator takes for ``nbytes``: each
    request is rounded up to a power of two, and a freed block is kept for reuse."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


_BACKENDS: dict[str, type[Backend]] = {"cpu": Backend, "cuda": CudaBackend}
"""The backend of each device type (tests put the CPU stand-in of CUDA here)."""


def backend_for(device: torch.device) -> Backend:
    """The backend of ``device``."""
    return _BACKENDS.get(device.type, Backend)(device)


def context_bytes(nvml: Any, uuid: str, pid: int, reserved: int, used_on_device: int) -> int:
    """The context of process ``pid`` on the GPU ``uuid``: what NVML says the process
    uses beyond what its allocator ``reserved``.

    The GPU is found by its UUID: under ``CUDA_VISIBLE_DEVICES`` a CUDA index is not
    NVML's. In a container NVML lists the host's PIDs, not ours: where the GPU runs one
    process only, that process is this one. Where NVML cannot say (no NVML, no
    permission, several processes none of which is ours), it falls back to what the whole
    device uses beyond the allocator, capped at 1 GiB since other processes may share it.
    """
    if nvml is not None and uuid:
        try:
            nvml.nvmlInit()
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
                procs = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            finally:
                nvml.nvmlShutdown()
        except Exception:  # NVML's own errors (no permission, unknown GPU): fall back
            procs = []
        ours = [p for p in procs if p.pid == pid] or (procs if len(procs) == 1 else [])
        if ours and ours[0].usedGpuMemory:
            return max(int(ours[0].usedGpuMemory) - reserved, 0)
    return min(max(used_on_device - reserved, 0), GIB)


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
