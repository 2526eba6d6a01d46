"""Detection models at a budget that binds (issue 55): torchvision's RetinaNet and Faster
R-CNN on a ResNet-18 FPN backbone (random weights, three stages trained), 16 images of 128
to 192 pixels a side, upright and flat, each with 1 to 3 boxes; global batch 16, SGD, fp32.
Each model pads a micro-batch to its largest image, so memory is not linear in the number
of images: every config the tuner verifies, its peak against its prediction.

    python benchmarks/detection.py --out benchmarks/results/detection-cpu.json   # ~8 min

Targets: every verified peak within 2% of its prediction (a micro-batch of one image, which
pads nothing, at most 2% over it), none over the budget.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package

import autotune
import benchmarks  # noqa: F401  (declares torchvision's ops first)

SIDES = (128, 193)
"""Image sides drawn from this range (the end excluded)."""


def retinanet() -> torch.nn.Module:
    from torchvision.models.detection import RetinaNet
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    backbone = resnet_fpn_backbone(
        backbone_name="resnet18", weights=None, trainable_layers=3,
        returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256),
    )  # fmt: skip
    return RetinaNet(backbone, num_classes=5, min_size=SIDES[0], max_size=SIDES[1] - 1)


def faster_rcnn() -> torch.nn.Module:
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=3)
    return FasterRCNN(
        backbone, num_classes=5, min_size=SIDES[0], max_size=SIDES[1] - 1,
        rpn_pre_nms_top_n_train=256, rpn_post_nms_top_n_train=64, box_batch_size_per_image=32,
    )  # fmt: skip


MODELS = {"retinanet": retinanet, "faster-rcnn": faster_rcnn}


def images(n: int, seed: int = 0) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    out, targets = [], []
    for _ in range(n):
        h, w = (int(x) for x in torch.randint(*SIDES, (2,), generator=g))
        out.append(torch.rand(3, h, w, generator=g))
        k = int(torch.randint(1, 4, (1,), generator=g))
        corner = torch.rand(k, 2, generator=g) * torch.tensor([w / 2, h / 2])
        boxes = torch.cat([corner, corner + 8 + torch.rand(k, 2, generator=g) * 40], 1)
        targets.append({"boxes": boxes, "labels": torch.randint(1, 5, (k,), generator=g)})
    return out, targets


def loss(output: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    return sum(output.values())  # type: ignore[return-value]


def run(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, batch = MODELS[name](), images(16)
    common: dict[str, Any] = {"device": "cpu", "loss_fn": loss}
    whole = autotune.TrainConfig(micro_batch_size=16, optimizer="sgd")
    peak, _ = autotune.estimate(model, batch, whole, **common)
    budget = 0.8 * peak  # the whole batch does not fit: the budget binds
    space = autotune.SearchSpace(precisions=("fp32",), optimizers=("sgd",))
    started = time.perf_counter()
    result = autotune.autotune(
        model, batch, budget / 2**30, global_batch_size=16, space=space, **common
    )
    trials = [
        {
            "config": t.config.describe(),
            "predicted": t.predicted.peak_bytes,
            "measured": t.measured.peak_bytes,
            "error": (t.measured.peak_bytes - t.predicted.peak_bytes) / t.predicted.peak_bytes,
            "micro_batch": t.config.micro_batch_size,
        }
        for t in result.trials
        if t.measured is not None
    ]
    for t in trials:
        print(
            f"{name}: {t['config']}: predicted {t['predicted'] / 2**20:.2f} MiB, verified "
            f"{t['measured'] / 2**20:.2f} MiB ({100 * t['error']:+.2f}%)",
            flush=True,
        )
    padded = [t["error"] for t in trials if t["micro_batch"] > 1]
    return {
        "model": name,
        "budget": result.budget_bytes,
        "winner": result.config.describe(),
        "tuning_s": time.perf_counter() - started,
        "trials": trials,
        "worst_padded": max((abs(e) for e in padded), default=0.0),
        "over_budget": any(t["measured"] > result.budget_bytes for t in trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/detection-cpu.json"))
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "command": "python benchmarks/detection.py --out benchmarks/results/detection-cpu.json",
        "runs": [run(name) for name in args.models],
    }
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
