"""Let torchvision (and so timm, and transformers' vision models) import on a CPU torch.

Shared by the tests (``conftest.py``) and the benchmarks (``benchmarks/__init__.py``).
"""

from __future__ import annotations

import importlib
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
    detection ops, so declaring their schemas lets the import through. Detection models
    (Faster R-CNN) call ``nms``: it gets a kernel in plain torch here, the C++ kernel's
    greedy rule, and ``roi_align`` takes torchvision's own pure-torch path, eager. Where
    they did load (a torchvision built for this torch), nothing here runs. Once per
    process: a second call (a benchmark script that imports the benchmarks package too)
    finds the ops declared.
    """
    if _KEPT:
        return
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
    ops.impl("nms", _nms, "CPU")
    _KEPT.append(ops)
    boxes = importlib.import_module("torchvision.ops.boxes")  # its nms asks for C++ ops
    roi_align = importlib.import_module("torchvision.ops.roi_align")  # not the function

    boxes._assert_has_ops = lambda: None
    # Its pure-torch roi_align runs eager, as the C++ kernel does: compiled (torchvision's
    # choice), each new shape would cost a test half a minute.
    roi_align._roi_align = roi_align._roi_align.__wrapped__


def _nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """torchvision's ``nms`` on the CPU: boxes by falling score, each kept unless its IoU
    with a box kept before it is over ``iou_threshold``; the kept indices, best first."""
    order = scores.argsort(descending=True)
    x1, y1, x2, y2 = dets[order].unbind(1)
    area = (x2 - x1) * (y2 - y1)
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    keep = []
    for i in range(len(order)):
        if suppressed[i]:
            continue
        keep.append(i)
        w = (torch.minimum(x2[i], x2[i + 1 :]) - torch.maximum(x1[i], x1[i + 1 :])).clamp(min=0)
        h = (torch.minimum(y2[i], y2[i + 1 :]) - torch.maximum(y1[i], y1[i + 1 :])).clamp(min=0)
        inter = w * h
        suppressed[i + 1 :] |= inter / (area[i] + area[i + 1 :] - inter) > iou_threshold
    return order[torch.tensor(keep, dtype=torch.long)]
