"""Whether a tuned result belongs to this model, device and torch.

A configuration tuned on one model or GPU can run out of memory on another; using it
there gives a warning (or, with ``strict=True``, an error) that says what differs.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from autotune._blocks import eager_module
from autotune.device import backend_for
from autotune.errors import ConfigError
from autotune.result import ModelInfo, TuneResult

__all__ = ["differences", "fingerprint", "refuse_another_model"]


def fingerprint(model: nn.Module) -> str:
    """A hash of the model's structure: module names and classes, tensor shapes and dtypes
    (of the module a ``torch.compile`` wrapper holds: the two are the same model)."""
    model = eager_module(model)
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__qualname__};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def refuse_another_model(info: ModelInfo, model: nn.Module, what: str, advice: str) -> None:
    """Refuse ``model`` where its structure is not the one ``info`` records (``what``: the
    file or plan it was recorded in; ``advice``: what to do instead). A record without a
    fingerprint (written by hand) is taken as it is.

    Raises:
        ConfigError: another model.
    """
    if not info.fingerprint or fingerprint(model) == info.fingerprint:
        return
    n = sum(p.numel() for p in model.parameters())
    raise ConfigError(
        f"{what} is for another model: a {info.class_name} of {info.n_parameters:,} "
        f"parameters, and this {type(model).__name__} has {n:,} or another structure; "
        f"{advice}"
    )


def differences(result: TuneResult, model: nn.Module, device: torch.device) -> list[str]:
    """What differs between where ``result`` was tuned and where it is about to run."""
    out = []
    if result.edited:
        out.append(
            "its config was edited after tuning, so its peak and speed were measured for "
            "another config (autotune verify runs this one)"
        )
    if fingerprint(model) != result.model.fingerprint:
        out.append(
            f"the model's structure differs from the {result.model.class_name} it was tuned on"
        )
    tuned = torch.device(result.target.device)
    if tuned.type != device.type:
        out.append(f"it was tuned on {tuned.type}, this run is on {device.type}")
    else:
        name = backend_for(device).name()
        if name != result.target.name:
            out.append(f"it was tuned on {result.target.name}, this device is {name}")
    if str(torch.__version__) != result.target.torch_version:
        tuned_with = result.target.torch_version
        out.append(f"it was tuned with torch {tuned_with}, this is {torch.__version__}")
    return out
