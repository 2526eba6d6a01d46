"""Markdown tables of a results JSON written by ``benchmarks/run.py``, for BENCHMARKS.md.

python benchmarks/markdown.py benchmarks/results/cpu.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["markdown"]

_MIB = 2**20


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def rows_table(rows: list[dict[str, Any]]) -> str:
    """One line per (case, budget): peaks, ratios, the configs behind them."""
    out = [
        "| case | budget | tuned config | predicted peak | measured peak | error "
        "| worst of verified trials | tuned / grid best (grid best) "
        "| tuned / baseline (baseline: found -> run) | tuned / hand (hand) | tuning s "
        "| violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r['budget']} {r['budget_bytes'] / _MIB:.1f} MiB"
        if r["error"]:
            out.append(f"| {r['case']} | {budget} | error: {r['error']} |" + " - |" * 9)
            continue
        tuned = r["details"]["tuned"]
        trials = r["trial_errors"]
        worst = max(trials, key=lambda e: abs(e["error"]), default=None)
        worst_text = (
            "-" if worst is None else f"{_pct(worst['error'])} ({worst['config']}; n={len(trials)})"
        )
        out.append(
            f"| {r['case']} | {budget} | {r['tuned']} "
            f"| {tuned['predicted']['peak_bytes'] / _MIB:.2f} MiB "
            f"| {tuned['measured']['peak_bytes'] / _MIB:.2f} MiB "
            f"| {_pct(r['peak_error_winner'])} "
            f"({tuned['predicted']['peak_bytes'] - tuned['measured']['peak_bytes']:+d} B) "
            f"| {worst_text} "
            f"| {_num(r['tuned_over_grid'])} ({r['grid_best']}) "
            f"| {_num(r['tuned_over_baseline'])} ({r['baseline_found']} -> {r['baseline']}) "
            f"| {_num(r.get('tuned_over_hand'))} ({r.get('hand') or '-'}) "
            f"| {_num(r['tuning_s'], '.0f')} | {r['violations']} |"
        )
    return "\n".join(out)


def summary_table(summary: dict[str, Any]) -> str:
    """The headline figures against their targets."""
    out = ["| figure | value | target | verdict |", "|---|---|---|---|"]
    for name, item in summary.items():
        if name == "extra":
            continue
        value = item["value"]
        if value is None:
            shown = "-"
        elif name.startswith(("peak_error", "step_error")):
            shown = _pct(value)
        elif isinstance(value, float):
            shown = f"{value:.3g}"
        else:
            shown = str(value)
        verdict = {True: "met", False: "**missed**", None: "n/a"}[item["met"]]
        target = item["target"]
        if name.startswith(("peak_error", "step_error")):
            op, bound = target.split()
            target = f"{op} {100 * float(bound):g}%"
        out.append(f"| {name} | {shown} | {target} | {verdict} |")
    return "\n".join(out)


def markdown(report: dict[str, Any]) -> str:
    """Both tables and the line that says where they come from."""
    m = report["machine"]
    flags = m.get("cpu_flags")
    shown = (
        f", CPU flags {' '.join(flags) or 'none of avx2/avx512/amx'}" if flags is not None else ""
    )
    head = (
        f"`{report['command']}`, {report['date']}, {m['name']} ({m['device']}){shown}, "
        f"torch {m['torch']}, {m['threads']} threads, {report['wall_s'] / 60:.1f} min"
    )
    return "\n\n".join([head, summary_table(report["summary"]), rows_table(report["rows"])])


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
