"""The GPUs a plan can target without being on one: memory, dense peaks, links.

Each entry's figures are the vendor's datasheet (NVIDIA's product pages and architecture
whitepapers): peak dense tensor FLOP/s (without structured sparsity, which training does
not use), the plain FP32 rate (what torch's default ``float32`` matmul, TF32 off, runs
at), memory bandwidth, the host link and, between GPUs of one server, NVLink where the
part has it (else PCIe), each per direction. Memory is what ``nvidia-smi`` reports.

Planning on them is NOT VERIFIED: a peak is an upper bound a real kernel reaches a
fraction of (:data:`MATMUL_EFFICIENCY`, :data:`MEMORY_EFFICIENCY`), and the CUDA context
and the caching allocator's reserve are stated defaults (:data:`CONTEXT_BYTES`,
:data:`RESERVE_SHARE`) until a GPU profile replaces them. A plan names each assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import ConfigError

__all__ = [
    "CONTEXT_BYTES",
    "DEVICES",
    "INTER_NODE_BYTES_PER_S",
    "MATMUL_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "RESERVE_SHARE",
    "DeviceSpec",
    "device_spec",
]

_MIB = 2**20
_T = 1e12
_G = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU, as its datasheet gives it.

    Attributes:
        name: The name a plan takes it by (``--device``).
        memory_bytes: Device memory, as ``nvidia-smi`` reports it.
        flops: Peak dense FLOP/s by precision: ``fp32`` (no TF32), ``bf16``, ``fp16``.
        bandwidth: Device memory bandwidth, bytes/s.
        host_link: Host<->device bandwidth per direction, bytes/s (PCIe).
        peer_link: GPU<->GPU bandwidth per direction within a server, bytes/s.
        per_server: GPUs a server holds (beyond them, ranks talk over the network).
        source: Where the figures come from.
    """

    name: str
    memory_bytes: int
    flops: dict[str, float]
    bandwidth: float
    host_link: float
    peer_link: float
    per_server: int
    source: str


_PCIE4 = 32 * _G  # x16, per direction
_PCIE5 = 64 * _G


def _spec(
    name: str,
    mib: int,
    fp32: float,
    bf16: float,
    bandwidth: float,
    host: float,
    peer: float,
    per_server: int,
    source: str,
) -> DeviceSpec:
    flops = {"fp32": fp32 * _T, "bf16": bf16 * _T, "fp16": bf16 * _T}
    return DeviceSpec(name, mib * _MIB, flops, bandwidth, host, peer, per_server, source)


DEVICES: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        _spec("H200-141GB", 143771, 67, 989.5, 4.8 * _T, _PCIE5, 450 * _G, 8,
              "NVIDIA H200 SXM datasheet (2024); memory as nvidia-smi reported on an H200"),
        _spec("H100-80GB", 81559, 67, 989.5, 3.35 * _T, _PCIE5, 450 * _G, 8,
              "NVIDIA H100 SXM5 datasheet (2023)"),
        _spec("H100-PCIe-80GB", 81559, 51, 756, 2.0 * _T, _PCIE5, _PCIE5, 8,
              "NVIDIA H100 PCIe datasheet (2023)"),
        _spec("A100-80GB", 81920, 19.5, 312, 2.039 * _T, _PCIE4, 300 * _G, 8,
              "NVIDIA A100 SXM4 80GB datasheet (2021)"),
        _spec("A100-40GB", 40960, 19.5, 312, 1.555 * _T, _PCIE4, 300 * _G, 8,
              "NVIDIA A100 SXM4 40GB datasheet (2020)"),
        _spec("L40S-48GB", 46068, 91.6, 362.05, 864 * _G, _PCIE4, _PCIE4, 8,
              "NVIDIA L40S datasheet (2023)"),
        _spec("A10-24GB", 23028, 31.2, 125, 600 * _G, _PCIE4, _PCIE4, 8,
              "NVIDIA A10 datasheet (2021)"),
        _spec("L4-24GB", 23034, 30.3, 121, 300 * _G, _PCIE4, _PCIE4, 8,
              "NVIDIA L4 datasheet (2023)"),
        _spec("RTX4090-24GB", 24564, 82.6, 165.2, 1008 * _G, _PCIE4, _PCIE4, 8,
              "NVIDIA Ada GPU architecture whitepaper (FP32 accumulate)"),
        _spec("RTX3090-24GB", 24576, 35.6, 71, 936 * _G, _PCIE4, _PCIE4, 8,
              "NVIDIA Ampere GA102 GPU architecture whitepaper (FP32 accumulate)"),
    )
}  # fmt: skip
"""The table, by name."""

MATMUL_EFFICIENCY = 0.6
"""The share of a peak FLOP rate a large matmul is taken to reach (stated, not measured)."""

MEMORY_EFFICIENCY = 0.8
"""The share of memory bandwidth a memory-bound op is taken to reach (stated)."""

CONTEXT_BYTES = 900 * 10**6
"""The CUDA context with cuBLAS's workspace: 872 MB measured on an H200 (torch 2.11,
CUDA 13, 2026-11-26), taken for every GPU until one is profiled."""

RESERVE_SHARE = 0.15
"""What the caching allocator reserves beyond the live bytes, as a share of the
activations: 6-16% measured at steady state on an H200 (GPT-2 124M, micro-batches 2-8)."""

INTER_NODE_BYTES_PER_S = 50 * _G
"""Between servers, per GPU and direction: one 400 Gb/s InfiniBand NDR link per GPU."""


def device_spec(name: str) -> DeviceSpec:
    """The table's entry for ``name`` (case and separators ignored).

    Raises:
        ConfigError: no such device; the message lists the table.
    """

    def key(s: str) -> str:
        return "".join(c for c in s.lower() if c.isalnum())

    found = {key(n): spec for n, spec in DEVICES.items()}
    if key(name) not in found:
        raise ConfigError(
            f"no device named {name!r} in autotune's table; use one of "
            f"{', '.join(DEVICES)} (or plan for a budget with the closest one)."
        )
    return found[key(name)]
