"""Budget overruns in real training: the tuned config trained for many steps on fresh batches.

For each held-in CPU case and each of its budgets (the tight ones included), the tuner
picks a config; then ``autotune.prepare(model, result)`` trains it on batches made fresh
every step, as a DataLoader makes them, while a live-bytes tracker that was started
before the first batch sees every byte the process allocates. A step whose peak passes
the budget is an overrun. Target: 0 over 1,000 steps.

    python benchmarks/overruns.py --steps 1000 --out /tmp/overruns.json   # ~10 min, 2 cores
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from benchmarks.budgets import budgets_for
from benchmarks.cases import cases_for

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="training steps in all")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    runs = [
        (case, budget) for case in cases_for(CPU) for budget in budgets_for(case, case.build(), CPU)
    ]
    per_run = -(-args.steps // len(runs))
    rows = []
    for case, budget in runs:
        model = case.build()
        started = time.perf_counter()
        result = autotune.autotune(
            model,
            case.sample(4),
            budget.gib,
            global_batch_size=case.global_batch_size,
            loss_fn=case.loss_fn,
            space=case.space,
            device="cpu",
        )
        tuned_s = time.perf_counter() - started
        n = result.config.effective_batch_size
        overruns, worst = 0, 0
        with autotune.prepare(copy.deepcopy(model), result, loss_fn=case.loss_fn) as runner:
            for _ in range(per_run):
                tracker = LiveBytesTracker("cpu")
                tracker.track(state_tensors(runner.model, runner.optimizer, runner.scaler))
                with tracker:  # the batch is made inside: a fresh one, as a loader makes it
                    batch = case.sample(n)
                    runner.step(batch)
                    del batch
                worst = max(worst, tracker.peak)
                overruns += tracker.peak > result.budget_bytes
        row = {
            "case": case.name,
            "budget": budget.name,
            "budget_bytes": result.budget_bytes,
            "config": result.config.describe(),
            "steps": per_run,
            "overruns": overruns,
            "worst_peak_bytes": worst,
            "verified_peak_bytes": result.measured.peak_bytes,
            "tuning_s": round(tuned_s, 1),
        }
        rows.append(row)
        args.out.write_text(json.dumps(rows, indent=1))
        print(
            f"{case.name:16s} {budget.name:10s} {row['config']:45s} overruns {overruns}/{per_run}"
            f"  worst {worst / result.budget_bytes:.3f} of the budget",
            flush=True,
        )
    total = sum(r["overruns"] for r in rows)
    print(f"overruns: {total} of {sum(r['steps'] for r in rows)} steps")


if __name__ == "__main__":
    main()
