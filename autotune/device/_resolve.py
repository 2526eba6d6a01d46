"""Devices as autotune holds them: one normal form, decided once where a device enters.

``torch.device("cuda") != torch.device("cuda:0")`` and ``torch.device("cpu:0") !=
torch.device("cpu")``, while tensors report ``cuda:N`` and ``cpu``: a device compared in
another form than its tensors' silently matches nothing (the offloader moved no tensor).
Every entry point (``prepare``, ``autotune``, ``estimate``, ``Runner``) resolves its
device here, so everything downstream compares like with like.
"""

from __future__ import annotations

import torch

from autotune.errors import ConfigError

__all__ = ["resolve_device"]


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """``device`` in the form its tensors report: ``cuda:N`` (index filled in) or ``cpu``.

    Args:
        device: A device or its name; ``None``: the current CUDA device if any, else CPU.

    Raises:
        ConfigError: ``device`` names no torch device.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"device {device!r} is not a torch device; pass 'cuda', 'cuda:N' or 'cpu'."
        ) from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type == "cuda" and resolved.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return resolved
