"""Numbers for people. GB in autotune means GiB (2**30 bytes), as ``nvidia-smi`` and torch
report memory."""

from __future__ import annotations

__all__ = ["GIB", "format_bytes"]

GIB = 2**30


def format_bytes(n: float) -> str:
    """Bytes for people: ``1.50 GiB``, ``320.0 MiB``, ``12.0 KiB``."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
