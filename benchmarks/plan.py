"""Planning Llama-3-8B- and 70B-shaped models before the hardware (issue 27).

Each model is built from its config on fake tensors (no weights, no memory) and planned
at 4096 tokens, global batch 64, for one 24 GB card, one 80 GB card, and 8 and 64 ranks
of 80 GB cards: the seconds it takes on this machine, the plan and its peak per rank (or
the least it needs when nothing fits). Beside each, what the estimators people use say
for the same model: accelerate's ``estimate-memory`` (training "using Adam" at batch 1,
mixed precision: weights only, times a factor) and DeepSpeed's model-states estimators
for ZeRO-2 and ZeRO-3 on those GPUs (no activations). The plans are NOT VERIFIED: the
GPU kit's ``plan`` step checks one against a real GPU.

    python benchmarks/plan.py --out benchmarks/results/plan-cpu.json
    python benchmarks/plan.py --trace-rank --out benchmarks/results/plan-traced-rank-cpu.json

``--trace-rank`` traces rank 0 of each FSDP2 plan with FSDP2 itself (a fake process group
of the plan's world size), the exact peak per rank beside the one-process plan's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the repository root and the tests' helpers
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "tests")]

from torchvision_ops import declare_torchvision_ops

import autotune
from autotune.integrations.hf_config import causal_lm
from autotune.measure import traced

declare_torchvision_ops()  # transformers imports torchvision: see tests/torchvision_ops.py

_LLAMA3 = {
    "model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "num_key_value_heads": 8, "dtype": "bfloat16",
}  # fmt: skip
MODELS = {
    "llama3-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32},
    "llama3-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672,
                   "num_hidden_layers": 80, "num_attention_heads": 64},
}  # fmt: skip
"""The published shapes of Llama 3 (the configs' fields that set the memory)."""

TARGETS = (("RTX4090-24GB", 24.0, 1), ("H100-80GB", 80.0, 1), ("H100-80GB", 80.0, 8),
           ("H100-80GB", 80.0, 64))  # fmt: skip
SEQ, GLOBAL_BATCH = 4096, 64


def estimators(model: torch.nn.Module, world: int) -> dict[str, int]:
    """What accelerate's and DeepSpeed's estimators say for ``model`` on ``world`` GPUs."""
    from accelerate.commands.estimate import calculate_maximum_sizes, estimate_training_usage
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total_bytes, (largest_bytes, _) = calculate_maximum_sizes(model)
    params = sum(p.numel() for p in model.parameters())
    per_node = min(world, 8)
    nodes = max(world // 8, 1)
    _, zero2 = estimate_zero2_model_states_mem_needs(params, per_node, nodes, cpu_offload=False)
    _, zero3, *_ = estimate_zero3_model_states_mem_needs(
        params, largest_bytes // 4, per_node, nodes, cpu_offload=False, cpu_offload_params=False
    )
    adam = max(estimate_training_usage(total_bytes, "bfloat16").values())
    return {"accelerate_adam_bs1": int(adam), "deepspeed_zero2": zero2, "deepspeed_zero3": zero3}


def plan_one(
    name: str, config: Path, device: str, budget: float, world: int, trace_rank: bool = False
) -> dict[str, Any]:
    """One plan: seconds, outcome, peak per rank, and the estimators beside it."""
    build, sample = causal_lm(config, SEQ)
    row: dict[str, Any] = {"model": name, "device": device, "budget_gib": budget, "world": world}
    started = time.perf_counter()
    try:
        result = autotune.plan_ahead(
            build,
            sample,
            budget,
            device=device,
            global_batch_size=GLOBAL_BATCH,
            world_size=world,
            trace_rank=trace_rank,
        )
        row.update(
            config=result.config.describe(),
            peak_bytes=result.predicted.peak_bytes,
            samples_per_s=result.predicted.samples_per_s,
            breakdown=dict(vars(result.breakdown)),
            parameters=result.model.n_parameters,
            traced_rank=next((n for n in result.unverified if n.startswith("rank 0 of")), None),
            trace_s=result.spent.verification_s,
        )
    except autotune.BudgetTooSmallError as exc:
        row.update(fits=False, minimum_bytes=exc.minimum_bytes, why=str(exc).split(":")[0])
    row["seconds"] = time.perf_counter() - started
    with traced():
        row["estimators"] = estimators(build(), world)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results-plan.json"))
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument(
        "--trace-rank", action="store_true", help="trace rank 0 of each FSDP2 plan (slower)"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = Path(tempfile.mkdtemp(prefix="autotune-plan-"))  # the configs, as users have them
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "seq": SEQ,
        "global_batch": GLOBAL_BATCH,
        "rows": [],
    }
    for name in args.models:
        config = folder / f"{name}.json"
        config.write_text(json.dumps(MODELS[name]))
        for device, budget, world in TARGETS:
            row = plan_one(name, config, device, budget, world, args.trace_rank)
            report["rows"].append(row)
            args.out.write_text(json.dumps(report, indent=1))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
