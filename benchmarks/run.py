"""Benchmark autotune against an exhaustive grid and accelerate's batch-size finder.

For each case (model) and budget: tune; run accelerate's ``find_executable_batch_size``
under the same budget; measure the exhaustive grid with the tuner's own Verifier; then
measure the tuned config, the baseline's config and the grid's best few again, round-robin,
and report ratios of their median throughputs (one run, one machine, as DESIGN asks).

    python benchmarks/run.py --device cpu --out benchmarks/results/cpu.json
    python benchmarks/run.py --device cuda --out benchmarks/results/cuda.json

See benchmarks/README.md for what each figure means.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while they wait turn a shared 2-core machine's short stalls into
# steps 10-50x slower (measured: 0.17 s steps taking 5-12 s next to one busy process);
# passive waiting keeps timings stable. It must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import datetime
import gc
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune.device._target import discover
from autotune.train._compiled import measured_compiling
from benchmarks.baseline import BaselineResult, describe, find_batch_baseline
from benchmarks.budgets import budgets_for
from benchmarks.cases import Case, cases_for
from benchmarks.grid import (
    SKIPPED,
    Sweep,
    grid_configs,
    hand_candidates,
    hand_config,
    median_throughput,
)
from benchmarks.report import Row, format_table, short, summarise
from benchmarks.tuning import fill_tuning, tune

_TOP = 3  # grid configs re-measured with the tuned and the baseline's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="first case, tightest budget, 1 round")
    parser.add_argument("--cases", nargs="*", help="only these case names")
    parser.add_argument("--budgets", nargs="*", help="only these budget names, e.g. 24GiB tight")
    parser.add_argument("--rounds", type=int, default=5, help="final interleaved rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    parser.add_argument("--out", type=Path, default=Path("results.json"))
    parser.add_argument("-v", "--verbose", action="store_true", help="the tuner's log")
    parser.add_argument("--full-grid", action="store_true", help="measure dominated configs too")
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="compiled blocks in the tuner's space (auto: its default, on CUDA only); the "
        "grid and the hand config stay eager",
    )
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    cases = [c for c in cases_for(device) if not args.cases or c.name in args.cases]
    compiled = {"auto": None, "on": True, "off": False}[args.compile]
    cases = [c.compiling(compiled) for c in cases]
    if args.quick:
        cases = cases[:1]
    started = time.perf_counter()
    rows: list[Row] = []
    for case in cases:
        with measured_compiling(bool(compiled)):  # the sweep re-measures a compiled winner
            rows.extend(
                run_case(
                    case,
                    device,
                    rounds=1 if args.quick else args.rounds,
                    quick=args.quick,
                    prune=not args.full_grid,
                    only=args.budgets,
                )
            )
    summary = summarise(rows)
    print(format_table(rows, summary))
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": _machine(device),
        "wall_s": time.perf_counter() - started,
        "summary": summary,
        "rows": [r.__dict__ for r in rows],
    }
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {args.out}")
    return 0


def run_case(
    case: Case,
    device: torch.device,
    *,
    rounds: int,
    quick: bool,
    prune: bool = True,
    only: list[str] | None = None,
) -> list[Row]:
    """Tune, baseline and sweep one case at each of its budgets."""
    model = case.build()
    blocks = (
        autotune.find_blocks(model)
        if case.space is None or case.space.blocks is None
        else case.space.blocks
    )
    target = discover(device)
    budgets = budgets_for(case, model, device)
    if only:
        budgets = [b for b in budgets if b.name in only]
    if quick:
        budgets = budgets[-1:]
    rows, sweep = [], None
    for budget in budgets:
        _log(f"{case.name} @ {budget.name} ({budget.budget_bytes / 2**20:.1f} MiB): {budget.why}")
        row = Row(case.name, budget.name, budget.budget_bytes, case.global_batch_size, len(blocks))
        rows.append(row)
        _release(device)  # CUDA: no cached blocks of ours may count in the tuner's peaks
        try:
            result, searched = tune(case, model, budget, device)
        except (autotune.AutotuneError, torch.OutOfMemoryError) as exc:
            # An OOM escaping autotune() would itself be a finding: record it, go on.
            row.error = f"{type(exc).__name__}: {exc}"
            _log(f"  tuning failed: {row.error}")
            continue
        fill_tuning(row, result, searched, len(blocks))
        _log(f"  tuned in {row.tuning_s:.0f} s: {row.tuned}")
        baseline = _baseline(row, case, model, device, result.budget_bytes, target.context_bytes)
        if sweep is None or device.type == "cuda":  # CPU: one sweep per case reuses exact peaks
            sweep = _new_sweep(case, model, device, target.context_bytes)
        configs = grid_configs(
            result, blocks, case.global_batch_size, searched.precisions, searched.optimizers
        )
        _sweep(row, sweep, configs, result, baseline.config, rounds=rounds, prune=prune)
        _log(
            f"  grid {row.grid_fit}/{row.grid_size} fit ({row.grid_skipped} dominated skipped), "
            f"best {row.grid_best}; tuned/grid {row.tuned_over_grid}, "
            f"tuned/baseline {row.tuned_over_baseline}, tuned/hand {row.tuned_over_hand} "
            f"(hand {row.hand})"
        )
        if device.type == "cuda":
            sweep = None
            _release(device)
    return rows


def _baseline(
    row: Row,
    case: Case,
    model: torch.nn.Module,
    device: torch.device,
    budget_bytes: int,
    context_bytes: int,
) -> BaselineResult:
    """Run accelerate's batch-size finder under the budget and record what it found."""
    baseline = find_batch_baseline(
        case, model, device=device, budget_bytes=budget_bytes, context_bytes=context_bytes
    )
    row.baseline = short(baseline.config, row.n_blocks)
    row.baseline_found = baseline.found_batch_size
    row.details["baseline"] = describe(baseline)
    _log(f"  baseline found {baseline.found_batch_size} -> {row.baseline}")
    return baseline


def _sweep(
    row: Row,
    sweep: Sweep,
    configs: list[autotune.TrainConfig],
    result: autotune.TuneResult,
    base: autotune.TrainConfig | None,
    *,
    rounds: int,
    prune: bool,
) -> None:
    """Measure the grid, then the tuned, baseline and top grid configs round-robin."""
    n = row.n_blocks
    points = sweep.grid(configs, result.budget_bytes, prune=prune)
    fitting = sorted(
        (p for p in points if p.measured is not None),
        key=lambda p: -p.measured.samples_per_s,  # type: ignore[union-attr]
    )
    row.grid_size, row.grid_fit = len(points), len(fitting)
    row.grid_skipped = sum(1 for p in points if p.error and p.error.startswith(SKIPPED))
    row.details["grid"] = [
        {
            "config": short(p.config, n),
            "peak_bytes": p.measured and p.measured.peak_bytes,
            "samples_per_s": p.measured and p.measured.samples_per_s,
            "error": p.error,
        }
        for p in points
    ]
    top = [p.config for p in fitting[:_TOP]]
    hands = hand_candidates(fitting, n)
    others = [c for c in (base, *hands) if c is not None]
    finalists = list(dict.fromkeys([result.config, *others, *top]))
    final = sweep.remeasure(finalists, result.budget_bytes, rounds=rounds)
    medians = {c: median_throughput(runs) for c, runs in final.items()}
    hand = hand_config({c: medians[c] for c in hands})
    row.hand = short(hand, n) if hand else None
    row.final = {short(c, n): m for c, m in medians.items()}
    row.details["final_runs"] = {
        short(c, n): [p.measured.samples_per_s if p.measured else p.error for p in runs]
        for c, runs in final.items()
    }
    _fill_ratios(row, result, base, top, medians, final, n)
    hand_median = medians.get(hand) if hand is not None else None
    tuned = medians.get(result.config)
    if tuned is not None and hand_median:
        row.tuned_over_hand = tuned / hand_median


def _fill_ratios(
    row: Row,
    result: autotune.TuneResult,
    base: autotune.TrainConfig | None,
    top: list[autotune.TrainConfig],
    medians: dict[autotune.TrainConfig, float | None],
    final: dict[autotune.TrainConfig, list[Any]],
    n: int,
) -> None:
    tuned = medians.get(result.config)
    failed = [
        p
        for p in final[result.config]
        if p.measured is None or p.measured.peak_bytes > row.budget_bytes
    ]
    row.violations += len(failed)
    row.details["tuned_reruns_failed"] = [p.error for p in failed]
    # The grid is eager: a compiled tuned config is measured against it, not in it.
    eager = not result.config.compile_blocks
    grid = {
        c: m
        for c, m in medians.items()
        if (c in top or (c == result.config and eager)) and m is not None
    }
    if grid:
        best = max(grid, key=grid.__getitem__)
        row.grid_best = short(best, n)
        row.tuned_over_grid = None if tuned is None else tuned / grid[best]
    base_median = medians.get(base) if base is not None else None
    if tuned is not None and base_median:
        row.tuned_over_baseline = tuned / base_median


def _new_sweep(
    case: Case, model: torch.nn.Module, device: torch.device, context_bytes: int
) -> Sweep:
    _release(device)
    foreign = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    return Sweep(
        copy.deepcopy(model).to(device),
        case.sample(min(case.global_batch_size or 8, 8)),
        device=device,
        loss_fn=case.loss_fn,
        context_bytes=context_bytes,
        foreign_bytes=foreign,
    )


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _machine(device: torch.device) -> dict[str, Any]:
    target = discover(device)
    return {
        "device": str(target.device),
        "name": target.name,
        "total_bytes": target.total_bytes,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": discover(torch.device("cpu")).name,
        "cpu_flags": cpu_flags(),
    }


_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "f16c")
"""The CPU flags that decide how fast the precisions run (bf16 is emulated without
``avx512_bf16`` or ``amx_bf16``, fp16 without ``avx512_fp16`` or ``amx_fp16``)."""


def cpu_flags() -> list[str]:
    """Which of :data:`_FLAGS` this CPU has, from ``/proc/cpuinfo`` (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return [f for f in _FLAGS if f in have]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
