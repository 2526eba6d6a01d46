"""Budget overruns in real training: the tuned config trained for many steps on fresh batches.

For each held-in CPU case and each of its budgets (the tight ones included), the tuner
picks a config; then ``autotune.prepare(model, result)`` trains it with ``for batch in
loader``, each batch made fresh while the loop still holds the last one, as a DataLoader
makes them, while a live-bytes tracker that was started before the first batch sees
every byte the process allocates. A step (from the making of its batch to the end of its
update) whose peak passes the budget is an overrun. Target: 0 over 1,000 steps.

    python benchmarks/overruns.py --steps 1000 --out /tmp/overruns.json   # ~10 min, 2 cores
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from benchmarks.budgets import budgets_for
from benchmarks.cases import Case, cases_for

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
            tracker = LiveBytesTracker("cpu")
            tracker.track(state_tensors(runner.model, runner.optimizer, runner.scaler))
            with tracker:  # started before the first batch: it sees every batch made
                for batch in _loader(case, n, per_run):
                    runner.step(batch)
                    worst = max(worst, tracker.peak)
                    overruns += tracker.peak > result.budget_bytes
                    tracker.peak = tracker.live  # the next step's window opens here
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


def _loader(case: Case, n: int, steps: int) -> Iterator[Any]:
    """``steps`` fresh batches of ``n`` samples, each made while the loop holds the last."""
    for _ in range(steps):
        yield case.sample(n)


if __name__ == "__main__":
    main()
