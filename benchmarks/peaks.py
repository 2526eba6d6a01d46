"""Predicted peaks of fixed configs on the CPU benchmark's models, for a change that must
not change them (a refactor): deterministic, no timing.

``autotune.estimate`` (the tuner's memory profile and cost model) for every micro-batch
of 1, 4 and 16 (accumulated to 32), fp32 and bf16, no, half or every block checkpointed,
AdamW and SGD, on each CPU case: 144 peaks and their breakdowns. And ``plan_ahead`` (the
traced profile, the GPU's translation, the cost model's search) of a 6-block GPT for an
RTX 4090 at 1.5 and 6 GiB, on 1 and 4 ranks: each winner and its ranked plans.

    python benchmarks/peaks.py --out before.json      # on the old code
    python benchmarks/peaks.py --out after.json       # on the new code
    python benchmarks/peaks.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package

import benchmarks  # noqa: F401  (declares torchvision's ops first)


def peaks() -> dict[str, list[object]]:
    """``{case and config: [peak bytes, breakdown]}`` on this tree's autotune."""
    import torch

    import autotune
    from benchmarks.cases import cases_for

    torch.set_num_threads(1)
    out: dict[str, list[object]] = {}
    for case in cases_for(torch.device("cpu")):
        model = case.build()
        blocks = autotune.find_blocks(model)
        masks = {"none": (), "half": tuple(blocks[: len(blocks) // 2]), "all": tuple(blocks)}
        grid = itertools.product((1, 4, 16), ("fp32", "bf16"), masks, ("adamw", "sgd"))
        for b, precision, ck, optimizer in grid:
            config = autotune.TrainConfig(
                micro_batch_size=b,
                grad_accum_steps=32 // b,
                precision=precision,
                checkpoint=masks[ck],
                optimizer=optimizer,
            )
            peak, breakdown = autotune.estimate(
                model, case.sample(4), config, device="cpu", loss_fn=case.loss_fn
            )
            out[f"{case.name} b{b}x{32 // b} {precision} ck={ck} {optimizer}"] = [
                peak,
                str(breakdown),
            ]
    return {**out, **plans()}


def plans() -> dict[str, list[object]]:
    """``{plan: [winner, its peak, [each ranked plan and its peak]]}``."""
    import autotune
    from autotune.models import example_batch, tiny_gpt

    out: dict[str, list[object]] = {}
    for world, budget_gb in itertools.product((1, 4), (1.5, 6.0)):
        result = autotune.plan_ahead(
            lambda: tiny_gpt(n_layer=6, n_embd=128, n_head=4, block_size=64, vocab_size=512),
            example_batch(),
            budget_gb,
            device="RTX4090-24GB",
            world_size=world,
            global_batch_size=32,
        )
        ranked = [[t.config.describe(), t.predicted.peak_bytes] for t in result.trials]
        out[f"plan w{world} {budget_gb} GiB"] = [
            result.config.describe(),
            result.predicted.peak_bytes,
            ranked,
        ]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the peaks here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two files to compare")
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        for k in differ:
            print(f"{k}: {a.get(k)} -> {b.get(k)}")
        print(f"{len(a)} and {len(b)} peaks and plans, {len(differ)} differ")
        return 1 if differ else 0
    Path(args.out or "peaks.json").write_text(json.dumps(peaks(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
