"""A plan made without the GPU, checked on the GPU (issue 27; the GPU kit's ``plan`` step).

First the model is planned as from a laptop: traced on fake tensors for the table's entry
of this GPU (``autotune.plan_ahead``). Then, on the GPU, the planned configuration is
trained for real under its budget by the tuner's verifier, and the model is tuned there
starting from the plan (``autotune.autotune(..., start_from=plan)``: the plan's config
verified first, beside the tuner's own). Reported: the planned peak against the measured one (target:
within 3%), and each stated default of the plan against what the GPU shows (the CUDA
context, the allocator's reserve, the roofline's step time against the measured one).
The JSON is rewritten after each stage.

    python benchmarks/plan_vs_gpu.py --out plan-vs-gpu.json               # on a GPU
    python benchmarks/plan_vs_gpu.py --device cpu --table H100-80GB --small --seq 64 \
        --budget-gb 1 --global-batch 8 --out /tmp/p.json  # a smoke run of the code
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the repository root and the tests' helpers
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "tests")]

from torchvision_ops import declare_torchvision_ops

import autotune
from autotune.device import CONTEXT_BYTES, DEVICES, backend_for, discover
from autotune.tuning import plan_record
from autotune.verify._verifier import Verifier
from benchmarks.mfu import table_name

declare_torchvision_ops()  # transformers imports torchvision: see tests/torchvision_ops.py


def gpu_table_name(gpu: str) -> str:
    """The table's entry for a GPU as torch names it (e.g. ``NVIDIA H200``)."""
    name = table_name(gpu)
    if name is None:
        raise SystemExit(f"no table entry for {gpu!r}; pass --table, one of {', '.join(DEVICES)}")
    return name


def model_and_batch(seq: int, small: bool) -> tuple[Any, Any]:
    """A ~0.5B LLaMA-style model (``small``: 2 layers of width 128) at ``seq`` tokens: a
    factory of it and one of a sample batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (128, 256, 2, 4, 2, 1000) if small else (1536, 4096, 16, 12, 4, 32000)
    width, ffn, layers, heads, kv, vocab = shape
    config = LlamaConfig(
        hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
    )  # fmt: skip

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    def sample() -> dict[str, torch.Tensor]:
        ids = torch.randint(
            0, config.vocab_size, (8, seq), generator=torch.Generator().manual_seed(0)
        )
        return {"input_ids": ids, "labels": ids}

    return build, sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--table", help="the table's entry to plan for (default: this GPU's)")
    parser.add_argument("--budget-gb", type=float, default=24.0)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke run)")
    parser.add_argument("--out", type=Path, default=Path("plan-vs-gpu.json"))
    args = parser.parse_args()
    target = discover(args.device)
    name = args.table or gpu_table_name(target.name)
    build, sample = model_and_batch(args.seq, args.small)
    out: dict[str, Any] = {"gpu": target.name, "table": name, "date": time.strftime("%Y-%m-%d")}
    started = time.perf_counter()
    plan = autotune.plan_ahead(
        build, sample, args.budget_gb, device=name, global_batch_size=args.global_batch
    )
    out["plan"] = {
        "seconds": time.perf_counter() - started,
        "config": plan.config.describe(),
        "predicted_peak_bytes": plan.predicted.peak_bytes,
        "predicted_samples_per_s": plan.predicted.samples_per_s,
        "breakdown": dict(vars(plan.breakdown)),
        "context_bytes_assumed": CONTEXT_BYTES,
    }
    args.out.write_text(json.dumps(out, indent=1))
    model, batch = build(), sample()
    verifier = Verifier(
        copy.deepcopy(model), batch, device=target.device,
        budget_bytes=int(args.budget_gb * 2**30), loss_fn=None,
        context_bytes=target.context_bytes,
        foreign_bytes=backend_for(target.device).foreign_bytes(),
    )  # fmt: skip
    measured, error = verifier.trial(plan.config)
    context = backend_for(target.device).context_bytes()
    out["planned_config_on_the_gpu"] = {
        "error": error,
        "measured_peak_bytes": measured.peak_bytes if measured else None,
        "measured_samples_per_s": measured.samples_per_s if measured else None,
        "context_bytes_measured": context,
        "peak_error": (plan.predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes
        if measured
        else None,
    }
    args.out.write_text(json.dumps(out, indent=1))
    tuned = autotune.autotune(
        model, batch, args.budget_gb, device=target.device, start_from=plan
    )  # the plan's global batch; its config verified first
    record = plan_record(tuned, plan)
    out["tuned_on_the_gpu"] = {
        "seconds": tuned.tuning_s,
        "config": tuned.config.describe(),
        "predicted_peak_bytes": tuned.predicted.peak_bytes,
        "measured_peak_bytes": tuned.measured.peak_bytes,
        "measured_samples_per_s": tuned.measured.samples_per_s,
        "plan_won": tuned.config == plan.config,
        "plan_measured_by_the_tuner": record.measured.peak_bytes
        if record and record.measured
        else None,
        "plan_error": record.error if record else "not run",
    }
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
