"""Throughput inside the trainers people use: autotune against their own batch-size finders
and against what an expert sets by hand.

For each CPU case and budget, inside Lightning (every case) and inside Hugging Face
``Trainer`` (the Hugging Face models): tune with autotune's integration and run the
trainer's own finder (Lightning's ``BatchSizeFinder(mode="binsearch")``, the ``Trainer``'s
``auto_find_batch_size``) under the same budget (the CPU budget guard), the global batch
kept exact with accumulation. The hand config is found as in the CPU benchmark
(``grid.hand_candidates``: fp32 and bf16, no or every block checkpointed at the largest
micro-batch that fits; the fastest of those over three rounds of the tuner's verifier)
and trained through the same integration as the tuned one, so that the two arms differ
only in the config (where it is the tuned config itself, the ratio is 1 and it is not
trained twice). Then train with each, round-robin, ``--rounds`` fits each, and report
the ratios of their median throughputs.

    python benchmarks/trainers.py --out benchmarks/results/trainers-cpu.json

Targets: against the finder (issue 12), >= 1.0 in every row, median >= 1.2, per trainer;
against the hand config (issue 25), >= 0.98 in every row.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see run.py

import argparse
import dataclasses
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

import autotune
from benchmarks import trainer_hf, trainer_lightning
from benchmarks.budgets import budgets_for
from benchmarks.cases import Case, cases_for
from benchmarks.grid import Sweep, hand_candidates, hand_config, median_throughput, sizes_for
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
    runs: dict[str, Callable[[], float]] = {
        "autotune": lambda: arms.timed_autotune(case, data, result),
        "baseline": lambda: arms.timed_baseline(case, data, found),
    }
    hand = _hand(case, budget)
    if hand is not None and hand.checkpoint:  # every block, as the trainer's module names them
        hand = hand.replace(checkpoint=result.model.blocks)
    if hand is not None:
        # The same config as the tuner's is the same run: timing it twice would only
        # measure the noise (0.91-1.11 on tiny_gpt's 0.1 s steps in Lightning).
        row["hand"] = {"config": hand.describe(), "same": hand == c}
        as_set = dataclasses.replace(result, config=hand, fallbacks=(), by_length=())
        if hand != c:
            runs["hand"] = lambda: arms.timed_autotune(case, data, as_set)
    timings: dict[str, list[float]] = {arm: [] for arm in runs}
    for _ in range(rounds):
        for arm, run in runs.items():
            timings[arm].append(run())
    for arm, values in timings.items():
        row[arm]["samples_per_s"] = values
        row[arm]["median"] = statistics.median(values)
    row["ratio"] = row["autotune"]["median"] / row["baseline"]["median"]
    if "hand" in row:
        if row["hand"]["same"]:
            row["hand"]["median"] = row["autotune"]["median"]
        row["ratio_hand"] = row["autotune"]["median"] / row["hand"]["median"]
    return row


def _hand(case: Case, budget: Any) -> autotune.TrainConfig | None:
    """What an expert sets by hand at this budget, found on the tuner's verifier as the CPU
    benchmark finds it: fp32 or bf16 (an expert does not train in fp16 on a CPU), AdamW,
    no or every block checkpointed, each at the largest micro-batch (dividing the global
    batch) that fits; the fastest of those, timed together in three rounds."""
    model = case.build()
    blocks = autotune.find_blocks(model)
    sweep = Sweep(model, case.sample(8), device=torch.device("cpu"), loss_fn=case.loss_fn)
    g = case.global_batch_size
    points = []
    for p in ("fp32", "bf16"):
        for mask in ((), blocks):
            for b in sorted(sizes_for(g), reverse=True):  # the largest that fits, then stop
                config = autotune.TrainConfig(
                    micro_batch_size=b,
                    grad_accum_steps=g // b if g else 1,
                    precision=p,
                    checkpoint=mask,
                )
                point = sweep.measure(config, budget.budget_bytes)
                if point.measured is not None:
                    points.append(point)
                    break
    candidates = hand_candidates(points, len(blocks))
    runs = sweep.remeasure(candidates, budget.budget_bytes, rounds=3)
    return hand_config({c: median_throughput(r) for c, r in runs.items()})


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
        hand = [r["ratio_hand"] for r in rows if r["trainer"] == trainer and "ratio_hand" in r]
        if hand:
            out[trainer] |= {
                "min_ratio_hand": min(hand),
                "median_ratio_hand": statistics.median(hand),
                "target_met_hand": min(hand) >= 0.98,
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
        + (
            f" | hand {r['hand']['config']} {r['hand']['median']:.1f}/s, ratio "
            f"{r['ratio_hand']:.2f}"
            if "ratio_hand" in r
            else ""
        )
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
