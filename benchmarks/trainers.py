"""Throughput inside the trainers people use: autotune against their own batch-size finders.

For each CPU case and budget, inside Lightning (every case) and inside Hugging Face
``Trainer`` (the Hugging Face models): tune with autotune's integration and run the
trainer's own finder (Lightning's ``BatchSizeFinder(mode="binsearch")``, the ``Trainer``'s
``auto_find_batch_size``) under the same budget (the CPU budget guard), the global batch
kept exact with accumulation. Then train with each, round-robin, ``--rounds`` fits each,
and report the ratio of their median throughputs.

    python benchmarks/trainers.py --out benchmarks/results-trainers-cpu.json

Targets (issue 12): ratio >= 1.0 in every row, median >= 1.2, per trainer.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see run.py

import argparse
import datetime
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import trainer_hf, trainer_lightning
from benchmarks.budgets import budgets_for
from benchmarks.cases import Case, cases_for
from benchmarks.run import _machine
from benchmarks.trainer_parts import TIMED, WARMUP

_ARMS: dict[str, Any] = {"lightning": trainer_lightning, "hf": trainer_hf}
_HF_CASES = ("hf-gpt2-small", "hf-llama-small")  # models the Trainer trains as they are


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="only these case names")
    parser.add_argument("--trainers", nargs="*", default=list(_ARMS), choices=list(_ARMS))
    parser.add_argument("--rounds", type=int, default=5, help="timed fits per arm")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("results-trainers.json"))
    args = parser.parse_args(argv)
    for name in ("lightning", "lightning.pytorch", "transformers", "autotune"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    started = time.perf_counter()
    rows = []
    for case in cases_for(device):
        if args.cases and case.name not in args.cases:
            continue
        budgets = budgets_for(case, case.build(), device)
        data = case.sample((case.global_batch_size or 32) * (WARMUP + TIMED))
        for trainer in args.trainers:
            if trainer == "hf" and case.name not in _HF_CASES:
                continue
            for budget in budgets:
                _log(f"{trainer} / {case.name} @ {budget.name}")
                rows.append(run_row(_ARMS[trainer], trainer, case, data, budget, args.rounds))
                _log(f"  {_line(rows[-1])}")
    summary = summarise(rows)
    print("\n".join([_line(r) for r in rows] + [json.dumps(summary)]))
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": _machine(device),
        "wall_s": time.perf_counter() - started,
        "steps": {"warmup": WARMUP, "timed": TIMED, "rounds": args.rounds},
        "summary": summary,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


def run_row(arms: Any, trainer: str, case: Case, data: Any, budget: Any, rounds: int) -> dict:
    """Tune and find, then time both, interleaved."""
    row: dict[str, Any] = {
        "trainer": trainer,
        "case": case.name,
        "budget": budget.name,
        "budget_bytes": budget.budget_bytes,
        "global_batch": case.global_batch_size,
    }
    result = arms.autotune_arm(case, data, budget)
    c = result.config
    row["autotune"] = {
        "config": c.describe(),
        "tuning_s": result.tuning_s,
        "predicted_peak": result.predicted.peak_bytes,
    }
    try:
        found = arms.finder_arm(case, data, budget)
    except Exception as exc:  # the finder's own failure is a result, not a crash
        row["baseline"] = {"error": f"{type(exc).__name__}: {exc}"}
        return row
    row["baseline"] = {
        "found": found.found,
        "batch_size": found.batch_size,
        "accumulate": found.accumulate,
        "finding_s": found.seconds,
    }
    timings: dict[str, list[float]] = {"autotune": [], "baseline": []}
    runs: dict[str, Callable[[], float]] = {
        "autotune": lambda: arms.timed_autotune(case, data, result),
        "baseline": lambda: arms.timed_baseline(case, data, found),
    }
    for _ in range(rounds):
        for arm, run in runs.items():
            timings[arm].append(run())
    for arm, values in timings.items():
        row[arm]["samples_per_s"] = values
        row[arm]["median"] = statistics.median(values)
    row["ratio"] = row["autotune"]["median"] / row["baseline"]["median"]
    return row


def summarise(rows: list[dict]) -> dict[str, Any]:
    """Per trainer: the ratios' minimum and median, against the targets."""
    out: dict[str, Any] = {}
    for trainer in sorted({r["trainer"] for r in rows}):
        ratios = [r["ratio"] for r in rows if r["trainer"] == trainer and "ratio" in r]
        if not ratios:
            continue
        low, mid = min(ratios), statistics.median(ratios)
        out[trainer] = {
            "rows": len(ratios),
            "min_ratio": low,
            "median_ratio": mid,
            "target_met": low >= 1.0 and mid >= 1.2,
        }
    return out


def _line(r: dict) -> str:
    base = r["baseline"]
    if "error" in base:
        return f"{r['trainer']:9} {r['case']:15} {r['budget']:9} finder failed: {base['error']}"
    return (
        f"{r['trainer']:9} {r['case']:15} {r['budget']:9} "
        f"autotune {r['autotune']['config']} {r['autotune']['median']:.1f}/s "
        f"(tuned in {r['autotune']['tuning_s']:.0f}s) | finder {base['found']} -> "
        f"{base['batch_size']}x{base['accumulate']} {base['median']:.1f}/s "
        f"(found in {base['finding_s']:.0f}s) | ratio {r['ratio']:.2f}"
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
