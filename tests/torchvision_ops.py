"""Let torchvision (and so timm, and transformers' vision models) import on a CPU torch.

Shared by the tests (``conftest.py``) and the benchmarks (``benchmarks/__init__.py``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["declare_torchvision_ops"]

_KEPT: list[object] = []
"""The library that declares the ops: alive as long as the process."""


def declare_torchvision_ops() -> None:
    """Let torchvision import on a CPU build of torch.

    The package index's torchvision wheels link CUDA torch: with a CPU torch their C++
    ops do not load, and torchvision's import then fails registering fake kernels for
    ``nms`` and ``qnms``. Classification models (torchvision's, timm's) never call those
    detection ops, so declaring their schemas lets the import through; calling one raises
    torch's own "no kernel" error.
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    library = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    try:
        if library is not None:
            torch.ops.load_library(str(library))
            return
    except OSError:
        pass
    ops = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        ops.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEPT.append(ops)
