"""The figures of one benchmark run: per-case rows, the summary against targets, the table.

Definitions (see benchmarks/README.md):

* peak error: ``|predicted - measured| / measured`` peak bytes, for the winner and for every
  trial the tuner verified (``result.trials``) that ran within the budget;
* tuned / grid best: median samples/s of the tuned config over the final interleaved
  rounds, over the best median among the grid's top configs in the same rounds;
* tuned / baseline: the same medians, tuned over the accelerate baseline's config;
* tuned / hand: the same medians, tuned over what an expert sets by hand (the faster of
  fp32 and the lower precisions, no checkpointing or every block, the largest micro-batch
  that fits: :func:`benchmarks.grid.hand_candidates`, the fastest of them in the final rounds);
* violations: the tuned config measured over the budget, in tuning or in any re-run.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autotune import TrainConfig, TuneResult

__all__ = ["TARGETS", "Row", "format_table", "peak_errors", "short", "step_error", "summarise"]

TARGETS: dict[str, tuple[str, float]] = {
    "peak_error_median": ("<=", 0.03),
    "peak_error_max": ("<=", 0.08),
    "tuned_over_grid_min": (">=", 0.97),
    "tuned_over_baseline_min": (">=", 1.0),
    "tuned_over_hand_min": (">=", 0.98),
    "step_error_median": ("<=", 0.10),
    "tuning_s_max": ("<=", 30.0),
    "budget_violations": ("<=", 0),
}


@dataclass
class Row:
    """Everything measured for one (case, budget)."""

    case: str
    budget: str
    budget_bytes: int
    global_batch_size: int | None
    n_blocks: int
    tuned: str | None = None
    tuning_s: float | None = None
    searched: str = ""
    peak_error_winner: float | None = None
    trial_errors: list[dict[str, Any]] = field(default_factory=list)
    rejected_trials: int = 0
    grid_size: int = 0
    grid_fit: int = 0
    grid_skipped: int = 0
    """Dominated checkpointed configs not run (the same micro-batch fits without)."""
    grid_best: str | None = None
    baseline: str | None = None
    baseline_found: int | None = None
    final: dict[str, float | None] = field(default_factory=dict)
    """Median samples/s over the final rounds, by config description."""
    tuned_over_grid: float | None = None
    tuned_over_baseline: float | None = None
    hand: str | None = None
    """What an expert sets by hand (see :func:`benchmarks.grid.hand_candidates`)."""
    tuned_over_hand: float | None = None
    violations: int = 0
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def short(config: TrainConfig | None, n_blocks: int) -> str:
    """``b16x2 bf16 ck0/4 adamw``: micro-batch x accumulation, precision (``bf16+compiled``:
    the blocks compiled), checkpointed blocks (``ck1+s2/4``: one checkpointed, two
    selectively), optimizer."""
    if config is None:
        return "-"
    selective = f"+s{len(config.selective_checkpoint)}" if config.selective_checkpoint else ""
    return (
        f"b{config.micro_batch_size}x{config.grad_accum_steps} {config.timeline} "
        f"ck{len(config.checkpoint)}{selective}/{n_blocks} {config.optimizer}"
    )


def peak_errors(result: TuneResult, n_blocks: int) -> tuple[list[dict[str, Any]], int]:
    """Relative peak error of every verified trial that fitted; and how many were rejected."""
    out, rejected = [], 0
    for trial in result.trials:
        if trial.measured is None:
            rejected += 1
            continue
        predicted, measured = trial.predicted.peak_bytes, trial.measured.peak_bytes
        out.append(
            {
                "config": short(trial.config, n_blocks),
                "checkpoint": list(trial.config.checkpoint),
                "selective_checkpoint": list(trial.config.selective_checkpoint),
                "predicted_peak_bytes": predicted,
                "measured_peak_bytes": measured,
                "error": (predicted - measured) / measured,
                "predicted_samples_per_s": trial.predicted.samples_per_s,
                # A fallback's peak alone: no speed measured, none claimed.
                "measured_samples_per_s": None if trial.peak_only else trial.measured.samples_per_s,
            }
        )
    return out, rejected


def step_error(trial: dict[str, Any]) -> float | None:
    """Relative error of a trial's predicted step time (the inverse of its throughput);
    ``None`` where its speed was not measured (a fallback's peak alone)."""
    measured = trial["measured_samples_per_s"]
    if not measured:
        return None
    return float(measured / trial["predicted_samples_per_s"] - 1)


def summarise(rows: Sequence[Row]) -> dict[str, Any]:
    """The headline figures over all rows, each with its target and whether it is met."""
    ok = [r for r in rows if r.error is None]
    trial_errs = [abs(e["error"]) for r in ok for e in r.trial_errors]
    step_errs = [abs(x) for r in ok for e in r.trial_errors if (x := step_error(e)) is not None]
    winner_errs = [abs(r.peak_error_winner) for r in ok if r.peak_error_winner is not None]
    grid = [r.tuned_over_grid for r in ok if r.tuned_over_grid is not None]
    base = [r.tuned_over_baseline for r in ok if r.tuned_over_baseline is not None]
    hand = [r.tuned_over_hand for r in ok if r.tuned_over_hand is not None]
    tuning = [r.tuning_s for r in ok if r.tuning_s is not None]
    figures: dict[str, float | None] = {
        "peak_error_median": statistics.median(trial_errs) if trial_errs else None,
        "peak_error_max": max(trial_errs) if trial_errs else None,
        "step_error_median": statistics.median(step_errs) if step_errs else None,
        "tuned_over_grid_min": min(grid) if grid else None,
        "tuned_over_baseline_min": min(base) if base else None,
        "tuned_over_hand_min": min(hand) if hand else None,
        "tuning_s_max": max(tuning) if tuning else None,
        "budget_violations": sum(r.violations for r in rows),
    }
    out: dict[str, Any] = {}
    for name, value in figures.items():
        op, target = TARGETS[name]
        met = None if value is None else (value <= target if op == "<=" else value >= target)
        out[name] = {"value": value, "target": f"{op} {target:g}", "met": met}
    out["extra"] = {
        "winner_peak_error_median": statistics.median(winner_errs) if winner_errs else None,
        "winner_peak_error_max": max(winner_errs) if winner_errs else None,
        "step_error_max": max(step_errs) if step_errs else None,
        "tuned_over_grid_median": statistics.median(grid) if grid else None,
        "tuned_over_baseline_median": statistics.median(base) if base else None,
        "tuned_over_hand_median": statistics.median(hand) if hand else None,
        "tuning_s_median": statistics.median(tuning) if tuning else None,
        "verified_trials": len(trial_errs),
        "rejected_trials": sum(r.rejected_trials for r in ok),
        "failed_rows": [f"{r.case}@{r.budget}: {r.error}" for r in rows if r.error],
    }
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(rows: Sequence[Row], summary: dict[str, Any]) -> str:
    """A plain-text table of the rows, then the summary against the targets."""
    head = (
        "case",
        "budget",
        "tuned config",
        "peak err",
        "worst trial",
        "tuned/grid",
        "grid best",
        "tuned/base",
        "baseline (found)",
        "tuned/hand",
        "hand",
        "tune s",
        "viol",
    )
    lines: list[tuple[str, ...]] = [head]
    for r in rows:
        if r.error is not None:
            lines.append((r.case, r.budget, f"ERROR: {r.error[:60]}", *("-",) * 10))
            continue
        worst = max(r.trial_errors, key=lambda e: abs(e["error"]), default=None)
        lines.append(
            (
                r.case,
                f"{r.budget} {r.budget_bytes / 2**20:.0f}MiB",
                r.tuned or "-",
                _pct(r.peak_error_winner),
                _pct(worst["error"] if worst else None),
                _ratio(r.tuned_over_grid),
                r.grid_best or "-",
                _ratio(r.tuned_over_baseline),
                f"{r.baseline or '-'} ({r.baseline_found})",
                _ratio(r.tuned_over_hand),
                r.hand or "-",
                "-" if r.tuning_s is None else f"{r.tuning_s:.0f}",
                str(r.violations),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    text.append("")
    for name, item in summary.items():
        if name == "extra":
            continue
        value = item["value"]
        shown = "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else value)
        verdict = {True: "met", False: "MISSED", None: "n/a"}[item["met"]]
        text.append(f"{name:26s} {shown!s:>10}  target {item['target']:>8}  {verdict}")
    return "\n".join(text)


def write_results(out: Path, rows: Sequence[dict[str, Any]], **extra: Any) -> None:
    """A benchmark script's results file: the command that made it, the date, torch's
    version, ``extra`` (the device, say) and its rows."""
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "torch": str(torch.__version__),
        **extra,
        "rows": list(rows),
    }
    out.write_text(json.dumps(report, indent=1))
