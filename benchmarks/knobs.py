"""What a knob buys: each CPU case tuned with it and without it, the two winners re-timed.

For each case and probed budget (as in ``run.py``), the tuner runs twice: with its default
space and with one knob turned off (``--knob selective``: ``SearchSpace(
selective_checkpointing=False)``). Where the two winners differ, both are measured again
by the tuner's verifier, round-robin, ``--rounds`` times each, and the row reports the
ratio of their median throughputs: what the knob bought on that case (1.00 where the
winner does not use it). Each row also gives, at the winner's micro-batch and precision,
the extra time of a forward+backward with every block checkpointed and with every block
checkpointed selectively, and the peak of each, from the profiler's own measurements.

    python benchmarks/knobs.py --out benchmarks/results/knobs-cpu.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see run.py

import argparse
import copy
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune._profile_data import CHECKPOINT, KEEP, SELECTIVE
from autotune.config import Timeline
from autotune.measure._profiler import Profiler
from benchmarks.budgets import budgets_for
from benchmarks.cases import Case, cases_for
from benchmarks.grid import Sweep, median_throughput
from benchmarks.report import short
from benchmarks.run import _machine

_OFF = {"selective": {"selective_checkpointing": False}}
"""The space with each knob turned off."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--knob", choices=list(_OFF), default="selective")
    parser.add_argument("--cases", nargs="*", help="only these case names")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved re-timings")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("results-knobs.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    started = time.perf_counter()
    rows = []
    for case in cases_for(device):
        if args.cases and case.name not in args.cases:
            continue
        model = case.build()
        for budget in budgets_for(case, model, device):
            rows.append(run_row(case, model, budget, args.knob, args.rounds))
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": _machine(device),
        "wall_s": time.perf_counter() - started,
        "knob": args.knob,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(_line(r) for r in rows))
    print(f"wrote {args.out}")
    return 0


def run_row(case: Case, model: torch.nn.Module, budget: Any, knob: str, rounds: int) -> dict:
    """Tune with and without ``knob``; re-time the two winners where they differ."""
    n = len(autotune.find_blocks(model))
    space = case.space or autotune.SearchSpace()
    results = {}
    for arm, arm_space in (("with", space), ("without", dataclasses.replace(space, **_OFF[knob]))):
        results[arm] = autotune.autotune(
            model,
            case.sample(8),
            budget_gb=budget.gib,
            loss_fn=case.loss_fn,
            global_batch_size=case.global_batch_size,
            device="cpu",
            space=arm_space,
            seed=0,
        )
    row: dict[str, Any] = {
        "case": case.name,
        "budget": budget.name,
        "with": short(results["with"].config, n),
        "without": short(results["without"].config, n),
        "tuning_s": {arm: r.tuning_s for arm, r in results.items()},
    }
    configs = [r.config for r in results.values()]
    if configs[0] == configs[1]:
        row["ratio"] = 1.0
    else:
        sweep = Sweep(copy.deepcopy(model), case.sample(8), device=torch.device("cpu"),
                      loss_fn=case.loss_fn)  # fmt: skip
        runs = sweep.remeasure(configs, results["with"].budget_bytes, rounds=rounds)
        medians = [median_throughput(runs[c]) for c in configs]
        row["medians"] = medians
        row["ratio"] = medians[0] / medians[1] if all(medians) else None
    row["variants"] = _variants(case, model, results["with"].config)
    return row


def _variants(case: Case, model: torch.nn.Module, config: autotune.TrainConfig) -> dict:
    """At ``config``'s micro-batch and precision: the extra forward+backward time of every
    block checkpointed and checkpointed selectively, and their one-step peaks."""
    blocks = autotune.find_blocks(model)
    profiler = Profiler(copy.deepcopy(model), case.sample(8), blocks, device=torch.device("cpu"),
                        loss_fn=case.loss_fn)  # fmt: skip
    b, p = config.micro_batch_size, config.precision
    times = profiler.fwd_bwd_times(Timeline(p), b, (KEEP, CHECKPOINT, SELECTIVE))
    base = autotune.TrainConfig(micro_batch_size=b, precision=p)
    peaks = {
        name: autotune.estimate(model, case.sample(8), c, device="cpu", loss_fn=case.loss_fn)[0]
        for name, c in (
            ("kept", base),
            ("checkpointed", base.replace(checkpoint=blocks)),
            ("selective", base.replace(selective_checkpoint=blocks)),
        )
    }
    return {
        "micro_batch": b,
        "precision": p,
        "recompute": {
            "checkpointed": times[CHECKPOINT] / times[KEEP] - 1,
            "selective": times[SELECTIVE] / times[KEEP] - 1,
        },
        "peak_bytes": peaks,
        "saved": {name: 1 - peaks[name] / peaks["kept"] for name in ("checkpointed", "selective")},
    }


def _line(r: dict) -> str:
    v = r["variants"]
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    return (
        f"{r['case']:15} {r['budget']:9} with {r['with']:28} without {r['without']:26} "
        f"bought {ratio} | b{v['micro_batch']} {v['precision']}: every block checkpointed "
        f"+{100 * v['recompute']['checkpointed']:.0f}% time -"
        f"{100 * v['saved']['checkpointed']:.0f}% peak, selectively "
        f"+{100 * v['recompute']['selective']:.0f}% time -{100 * v['saved']['selective']:.0f}% peak"
    )


if __name__ == "__main__":
    sys.exit(main())
