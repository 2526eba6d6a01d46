"""``CudaBackend``, the only code that calls ``torch.cuda``, run against a fake ``torch.cuda``.

CI has no GPU. These tests check that each call reaches torch with this device and that
the logic around the calls holds (the cap gives back the user's fraction, the context
is found through NVML); tests/device/test_cuda.py runs the same class on a real GPU.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from autotune._format import GIB
from autotune.device import _backend
from autotune.device._backend import CudaBackend, backend_for, pinned_bytes
from autotune.device._resolve import resolve_device

DEVICE = torch.device("cuda", 1)


class FakeCuda:
    """The ``torch.cuda`` calls CudaBackend makes, with a GPU's answers; calls are logged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fraction = 0.7  # what the user set
        self.total = 80 * GIB
        self.reserved = 3 * GIB
        answers = {
            "is_available": lambda: True,
            "current_device": lambda: 1,
            "get_device_name": lambda d: "NVIDIA H100 80GB HBM3",
            "is_bf16_supported": lambda: True,
            "mem_get_info": lambda d: (self.total - 4 * GIB, self.total),
            "memory_reserved": lambda d: self.reserved,
            "max_memory_reserved": lambda d: 2 * self.reserved,
            "get_device_properties": lambda d: types.SimpleNamespace(
                total_memory=self.total, uuid="abc"
            ),
            "get_per_process_memory_fraction": lambda d: self._indexed(d) and self.fraction,
            "set_per_process_memory_fraction": self._set_fraction,
            "get_rng_state_all": lambda: ["state"],
            "Stream": lambda d: ("stream", d),
            "current_stream": lambda d: ("current", d),
            "stream": lambda s: ("context", s),
        }
        for name, answer in answers.items():
            monkeypatch.setattr(torch.cuda, name, self._logged(name, answer))
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, self._logged(name, lambda *a: None))

    def _logged(self, name: str, answer: Any) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return answer(*args)

        return call

    def _set_fraction(self, fraction: float, device: torch.device | int) -> None:
        assert self._indexed(device) and torch.device("cuda", device) == DEVICE
        self.fraction = fraction

    @staticmethod
    def _indexed(device: torch.device | int) -> bool:
        """torch's per-process fraction takes an index: ``cuda`` alone raises ValueError."""
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index, got {device}")
        return True

    def called(self, name: str) -> list[Any]:
        return [args for n, args in self.calls if n == name]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def test_a_cuda_device_without_an_index_is_the_current_one(fake_cuda) -> None:
    assert resolve_device("cuda") == DEVICE
    assert resolve_device(None) == DEVICE  # a GPU is the default where there is one
    assert isinstance(backend_for(DEVICE), CudaBackend)


def test_the_allocator_statistics_are_this_devices(fake_cuda) -> None:
    ops = CudaBackend(DEVICE)
    assert ops.available() and ops.supports_bf16()
    assert ops.name() == "NVIDIA H100 80GB HBM3"
    assert (ops.reserved(), ops.max_reserved()) == (3 * GIB, 6 * GIB)
    assert (ops.total(), ops.free()) == (80 * GIB, 76 * GIB)
    ops.reset_peak()
    ops.synchronize()
    ops.empty_cache()
    assert fake_cuda.called("reset_peak_memory_stats") == [(DEVICE,)]
    assert fake_cuda.called("synchronize") == [(DEVICE,)]
    assert fake_cuda.called("memory_reserved") == [(DEVICE,)]
    assert fake_cuda.called("empty_cache") == [()]


def test_the_cap_is_a_fraction_of_the_device_and_the_users_comes_back(fake_cuda) -> None:
    ops = CudaBackend(DEVICE)
    with ops.cap(20 * GIB):
        assert fake_cuda.fraction == 0.25
    assert fake_cuda.fraction == 0.7
    with ops.cap(None):  # no cap: the user's stays
        assert fake_cuda.fraction == 0.7
    with pytest.raises(torch.OutOfMemoryError), ops.cap(200 * GIB):
        assert fake_cuda.fraction == 1.0  # at most the whole device
        raise torch.OutOfMemoryError("out of memory")
    assert fake_cuda.fraction == 0.7  # given back on an error too


def test_the_cap_of_a_device_without_an_index_is_the_current_ones(fake_cuda) -> None:
    with CudaBackend(torch.device("cuda")).cap(20 * GIB):  # as a caller may pass it
        assert fake_cuda.fraction == 0.25
    assert fake_cuda.fraction == 0.7


def test_without_a_way_to_read_the_users_fraction_the_default_comes_back(
    fake_cuda, monkeypatch
) -> None:
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")
    with CudaBackend(DEVICE).cap(40 * GIB):
        assert fake_cuda.fraction == 0.5
    assert fake_cuda.fraction == 1.0  # torch < 2.7 cannot say; 1.0 is its default


def test_the_context_is_what_nvml_sees_of_this_process_beyond_the_allocator(
    fake_cuda, monkeypatch
) -> None:
    import os

    from fake_nvml import FakeNvml, Proc

    nvml = FakeNvml({"GPU-abc": [Proc(os.getpid(), 3 * GIB + 500 * 2**20)]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert CudaBackend(DEVICE).context_bytes() == 500 * 2**20
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the device's view
    assert CudaBackend(DEVICE).context_bytes() == GIB  # 4 GiB used, 3 reserved


def test_streams_are_this_devices(fake_cuda) -> None:
    ops = CudaBackend(DEVICE)
    stream = ops.new_stream()
    assert stream == ("stream", DEVICE) and ops.current_stream() == ("current", DEVICE)
    assert ops.use_stream(stream) == ("context", stream)
    recorded = []
    tensor = types.SimpleNamespace(record_stream=recorded.append)
    ops.record_stream(tensor, stream)  # type: ignore[arg-type]
    assert recorded == [stream]


def test_random_state_and_pinned_memory(fake_cuda, monkeypatch) -> None:
    ops = CudaBackend(DEVICE)
    ops.set_rng_state(ops.rng_state())
    assert fake_cuda.called("set_rng_state_all") == [(["state"],)]
    released = []
    monkeypatch.setattr(
        torch,
        "accelerator",
        types.SimpleNamespace(empty_host_cache=lambda: released.append(1)),
        raising=False,
    )
    ops.empty_host_cache()
    assert released == [1]
    monkeypatch.setattr(torch, "accelerator", types.SimpleNamespace(), raising=False)
    ops.empty_host_cache()  # torch < 2.8 cannot release: nothing to do
    assert ops.host_bytes(3 * 2**20) == 4 * 2**20 == pinned_bytes(3 * 2**20)
    assert (pinned_bytes(0), pinned_bytes(1), pinned_bytes(4096)) == (0, 1, 4096)


def test_the_cpu_backend_has_nothing_to_do() -> None:
    ops = _backend.Backend(torch.device("cpu"))
    assert ops.available() and ops.free() == 0 and ops.rng_state() is None
    assert ops.host_bytes(3) == 3 and ops.name()
    with pytest.raises(NotImplementedError):
        ops.new_stream()
    with pytest.raises(NotImplementedError):
        ops.current_stream()
