"""Where a tuning run's seconds go (issue 57): each case of the CPU benchmark at each of
its budgets, tuned once in a fresh process, the stages' seconds (``result.spent``) and the
configs run for real (timed, or for their peak alone: a fallback's).

    python benchmarks/tuning_time.py --out benchmarks/results/tuning-time-cpu.json  # ~4 min

Target: at most 30 s a run and 15 s median on the 2-core CPU. ``--max-tuning-s S``: each
run within S seconds (``max_tuning_s``), what it skipped in its row. ``--kinds``: the
held-out kinds (:mod:`benchmarks.kinds`) at half and a tight budget instead:

    python benchmarks/tuning_time.py --kinds --out benchmarks/results/tuning-time-kinds-cpu.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see run.py

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]


def one(case_name: str, budget_name: str, limit: float | None, kinds: bool) -> dict[str, Any]:
    """Tune one case at one budget in this process (a fresh one: ``--one``), within
    ``limit`` seconds (``max_tuning_s``) where one is given; a held-out kind's where
    ``kinds``."""
    import torch

    sys.path.insert(0, str(_ROOT))
    from benchmarks.budgets import HALF_AND_TIGHT, budgets_for
    from benchmarks.cases import cases_for
    from benchmarks.kinds import kind_cases
    from benchmarks.tuning import tune

    torch.set_num_threads(2)
    device = torch.device("cpu")
    cases = kind_cases() if kinds else cases_for(device)
    case = next(c for c in cases if c.name == case_name)
    model = case.build()
    found = (
        budgets_for(case, model, device, HALF_AND_TIGHT)
        if kinds
        else budgets_for(case, model, device)
    )
    budget = next(b for b in found if b.name == budget_name)
    started = time.perf_counter()
    result, _ = tune(case, model, budget, device, max_tuning_s=limit)
    wall = time.perf_counter() - started
    spent = result.spent
    return {
        "case": case_name,
        "budget": budget_name,
        "budget_bytes": budget.budget_bytes,
        "tuned": result.config.describe(),
        "predicted_peak": result.predicted.peak_bytes,
        "measured_peak": result.measured.peak_bytes if result.measured else None,
        "samples_per_s": result.measured.samples_per_s if result.measured else None,
        "tuning_s": result.tuning_s,
        "wall_s": wall,
        "profile_s": spent.profile_s,
        "search_s": spent.search_s,
        "verification_s": spent.verification_s,
        "timed": sum(t.measured is not None and not t.peak_only for t in result.trials),
        "peak_only": sum(t.peak_only for t in result.trials),
        "rejected": sum(t.measured is None for t in result.trials),
        "max_tuning_s": limit,
        "skipped": list(result.skipped),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("CASE", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--max-tuning-s", type=float, help="each run's max_tuning_s")
    parser.add_argument(
        "--kinds", action="store_true", help="the held-out kinds (benchmarks/kinds.py)"
    )
    parser.add_argument("--only", nargs="*", help="these cases alone")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.one:
        row = one(*args.one, args.max_tuning_s, args.kinds)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    limit = [] if args.max_tuning_s is None else ["--max-tuning-s", str(args.max_tuning_s)]
    if args.kinds:
        sys.path.insert(0, str(_ROOT))
        from benchmarks.kinds import kind_cases

        names, budgets = [c.name for c in kind_cases()], ("half", "tight")
        limit.append("--kinds")
    else:
        names = ["tiny_gpt", "hf-gpt2-small", "hf-llama-small", "resnet-small"]
        budgets = ("fp32-no-G", "tight")
    pairs = [(c, b) for c in names if not args.only or c in args.only for b in budgets]
    rows = []
    for case, budget in pairs:
        done = subprocess.run(
            [sys.executable, __file__, "--one", case, budget, *limit],
            capture_output=True,
            text=True,
            check=False,
        )
        found = [x for x in done.stdout.splitlines() if x.startswith("ROW ")]
        if done.returncode or not found:  # kept as a row: a kind the tuner fails on is news
            error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"case": case, "budget": budget, "error": error})
            print(f"{case:15} {budget:10} failed: {error}", flush=True)
            continue
        row = json.loads(found[0][4:])
        rows.append(row)
        print(
            f"{case:15} {budget:10} {row['tuning_s']:5.1f} s (profile {row['profile_s']:.1f}, "
            f"verification {row['verification_s']:.1f}; {row['timed']} timed, "
            f"{row['peak_only']} peak only)  {row['tuned']}",
            flush=True,
        )
    seconds = [r["tuning_s"] for r in rows if "error" not in r]
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "median_s": statistics.median(seconds),
        "max_s": max(seconds),
        "rows": rows,
    }
    print(f"median {report['median_s']:.1f} s, max {report['max_s']:.1f} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
