"""Fused AdamW against the foreach one: step time (with its spread) and the step's transient
memory, measured by autotune's profiler on the same model (issue 37).

    python benchmarks/fused_adamw.py --device cpu --out /tmp/fused.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see run.py)

import argparse
import copy
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune.measure._profiler import Profiler
from autotune.models import gpt_batch, tiny_gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="profiles of each optimizer")
    parser.add_argument("--out", type=Path, default=Path("fused-adamw.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    model = tiny_gpt(n_layer=8, n_embd=512, n_head=8, block_size=64, vocab_size=4096)
    batch = gpt_batch(model.config, 2)
    blocks = autotune.find_blocks(model)
    rows = {}
    for name in ("adamw", "adamw_fused"):
        runs = []
        for _ in range(args.repeats):
            work = copy.deepcopy(model).to(device)
            runs.append(
                Profiler(work, batch, blocks, device=device, loss_fn=None).optimizer(name, 2)
            )
        steps = [r.step_s for r in runs]
        rows[name] = {
            "state_bytes": runs[0].state_bytes,
            "step_peak_bytes": runs[0].step_peak_bytes,
            "step_s_median": statistics.median(steps),
            "step_s_min": min(steps),
            "step_s_max": max(steps),
        }
        print(name, json.dumps(rows[name]), flush=True)
    params = sum(p.numel() for p in model.parameters())
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": str(torch.__version__),
        "threads": torch.get_num_threads(),
        "parameters": params,
        "optimizers": rows,
        "speed-up": rows["adamw"]["step_s_median"] / rows["adamw_fused"]["step_s_median"],
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(f"fused AdamW steps {report['speed-up']:.2f}x faster; wrote {args.out}")


if __name__ == "__main__":
    main()
