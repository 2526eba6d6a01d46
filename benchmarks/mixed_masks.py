"""Predicted against measured peaks of mixed per-block masks (issue 47): a block or two
checkpointed, whole or selectively, beside kept ones, on models whose tensors outlive a
block (a UNet's skip connections, a ResNet's block outputs saved by two blocks, a
decoder's rotary tables shared by every layer).

Predicted: ``autotune.estimate`` (the profile's uniform runs, every block kept or every
block checkpointed, replayed with the mask). Measured: the verifier's step of the same
config on the CPU, whose tracker is exact. Deterministic, no timing.

    python benchmarks/mixed_masks.py --out benchmarks/results/mixed-masks-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests"), str(_ROOT / "tests" / "models")]

from torchvision_ops import declare_torchvision_ops  # noqa: E402

declare_torchvision_ops()  # transformers imports torchvision: see tests/torchvision_ops.py
import torch  # noqa: E402
import zoo  # noqa: E402
from matrix_checks import measured_peak  # noqa: E402

import autotune  # noqa: E402
from benchmarks.report import write_results  # noqa: E402

Built = tuple[torch.nn.Module, Any, Any]


def lora_qwen2() -> Built:
    """LoRA adapters on a 4-layer Qwen2: the base frozen, the rotary tables shared."""
    import peft
    import transformers

    config = transformers.Qwen2Config(
        **{**zoo._DECODER, "num_hidden_layers": 4}, num_key_value_heads=2
    )
    base = transformers.Qwen2ForCausalLM(config)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, lora), zoo.lm_batch(), None


def _cases(blocks: tuple[str, ...], name: str) -> list[autotune.TrainConfig]:
    config = autotune.TrainConfig
    if name == "unet":  # down, down, mid, up, up
        return [
            config(micro_batch_size=4, selective_checkpoint=blocks[:1]),
            config(micro_batch_size=4, selective_checkpoint=blocks[1:2]),
            config(micro_batch_size=4, selective_checkpoint=blocks[3:4]),  # ends in a conv
            config(micro_batch_size=4, checkpoint=blocks[:1]),
            config(
                micro_batch_size=2, grad_accum_steps=2, checkpoint=blocks[:2], eval_batch_size=8
            ),
        ]
    if name == "resnet18":  # two blocks a stage, BatchNorm, each output saved by its ReLU
        return [
            config(micro_batch_size=4, checkpoint=blocks[2:3]),
            config(micro_batch_size=4, checkpoint=(blocks[0], blocks[5])),
            config(micro_batch_size=4, checkpoint=blocks[-1:]),
        ]
    return [
        config(micro_batch_size=4, checkpoint=blocks[:2]),
        config(micro_batch_size=4, checkpoint=blocks[1:3]),
        config(
            micro_batch_size=2,
            grad_accum_steps=2,
            selective_checkpoint=blocks[1:2],
            eval_batch_size=16,
        ),
        config(micro_batch_size=4),
    ]


MODELS: dict[str, Callable[[], Built]] = {
    "unet": zoo.unet,
    "resnet18": zoo.torchvision_resnet18,
    "lora-qwen2": lora_qwen2,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("mixed-masks.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, build in MODELS.items():
        zoo.seed_everything(0)
        model, batch, loss = build()
        blocks = autotune.find_blocks(model)
        for config in _cases(blocks, name):
            predicted, _ = autotune.estimate(model, batch, config, device="cpu", loss_fn=loss)
            peak = measured_peak(model, batch, config, loss)
            row = {
                "model": name,
                "config": config.describe(),
                "checkpointed": list(config.checkpoint + config.selective_checkpoint),
                "predicted_bytes": predicted,
                "measured_bytes": peak,
                "error_percent": round(100 * (predicted - peak) / peak, 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
