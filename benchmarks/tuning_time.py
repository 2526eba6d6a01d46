"""Where a tuning run's seconds go (issue 57): each case of the CPU benchmark at each of
its budgets, tuned once in a fresh process, the stages' seconds (``result.spent``) and the
configs run for real (timed, or for their peak alone: a fallback's).

    python benchmarks/tuning_time.py --out benchmarks/results/tuning-time-cpu.json  # ~4 min

Target: at most 30 s a run and 15 s median on the 2-core CPU. ``--max-tuning-s S``: each
run within S seconds (``max_tuning_s``), what it skipped in its row. ``--kinds``: the
held-out kinds (:mod:`benchmarks.kinds`) at half and a tight budget instead:

    python benchmarks/tuning_time.py --kinds --out benchmarks/results/tuning-time-kinds-cpu.json

A shared machine's speed drifts (the same run took 14 s and 34 s an hour apart on the
2-core VM): ``--passes N`` runs every case N times, the passes one after the other, and
reports each case's fastest, median and slowest run beside each pass's median and max.
Each row carries ``host_probe_s``, a fixed workload timed in the run's process just before
it tunes, so that a slow row can be told from a slow host.
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
    probe = _host_probe()
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
        "host_probe_s": probe,
    }


def _host_probe() -> float:
    """Seconds of a fixed workload (small matrix products and a Python loop, as a tracked
    step's mix of kernels and interpreter): how fast the host is right now."""
    import torch

    a = torch.ones(256, 256)
    start = time.perf_counter()
    for _ in range(600):
        a = (a @ a).clamp_(max=1.0)
    total = 0
    for i in range(3_000_000):
        total += i
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("CASE", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--max-tuning-s", type=float, help="each run's max_tuning_s")
    parser.add_argument(
        "--kinds", action="store_true", help="the held-out kinds (benchmarks/kinds.py)"
    )
    parser.add_argument("--only", nargs="*", help="these cases alone")
    parser.add_argument("--passes", type=int, default=1, help="run every case this many times")
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
    for case, budget in [p for _ in range(args.passes) for p in pairs]:
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
        row["pass"] = sum(r["case"] == case and r["budget"] == budget for r in rows)
        rows.append(row)
        print(
            f"{case:15} {budget:10} {row['tuning_s']:5.1f} s (profile {row['profile_s']:.1f}, "
            f"verification {row['verification_s']:.1f}; {row['timed']} timed, "
            f"{row['peak_only']} peak only; host probe {row['host_probe_s']:.2f} s)  "
            f"{row['tuned']}",
            flush=True,
        )
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        **_summary(rows, pairs, args.passes),
        "rows": rows,
    }
    print(f"median {report['median_s']:.1f} s, max {report['max_s']:.1f} s")
    for k, p in enumerate(report["passes"]):
        print(f"pass {k}: median {p['median_s']:.1f} s, max {p['max_s']:.1f} s")
    if args.passes > 1:
        by_case = report["by_case"]
        fastest = [c["fastest_s"] for c in by_case]
        print(
            f"each case's fastest of {args.passes}: median {statistics.median(fastest):.1f} s, "
            f"max {max(fastest):.1f} s"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


def _summary(
    rows: list[dict[str, Any]], pairs: list[tuple[str, str]], passes: int
) -> dict[str, Any]:
    """Median and max over every run, each pass's, and each case's runs across passes."""
    ok = [r for r in rows if "error" not in r]

    def spread(seconds: list[float]) -> dict[str, float]:
        return {"median_s": statistics.median(seconds), "max_s": max(seconds)}

    by_case = []
    for case, budget in pairs:
        runs = sorted(r["tuning_s"] for r in ok if r["case"] == case and r["budget"] == budget)
        if runs:
            by_case.append(
                {
                    "case": case,
                    "budget": budget,
                    "fastest_s": runs[0],
                    "median_s": statistics.median(runs),
                    "slowest_s": runs[-1],
                }
            )
    return {
        **spread([r["tuning_s"] for r in ok]),
        "passes": [spread([r["tuning_s"] for r in ok if r["pass"] == k]) for k in range(passes)],
        "by_case": by_case,
    }


if __name__ == "__main__":
    sys.exit(main())
