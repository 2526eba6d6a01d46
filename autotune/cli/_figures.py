"""A result's figures in words, as far as they are true of the config in hand: measured,
predicted only (a plan, nothing run), or another config's (the file was edited); what
``show``, ``tune`` and the report print; and how sure a result is (:func:`sureness`)."""

from __future__ import annotations

from autotune._format import format_bytes
from autotune.result import PLANNED, TuneResult

__all__ = ["figures", "sureness"]


def _planned_here(result: TuneResult) -> bool:
    """Whether ``result`` is a plan for a GPU that is not where it was made (its device is
    the machine that traced it: naming it would say the plan ran there)."""
    return any(t.error == PLANNED for t in result.trials)


def figures(result: TuneResult) -> list[tuple[str, str]]:
    """(label, text) rows: the budget, the peak and the throughput."""
    p, m = result.predicted, result.measured
    everyone = f", all {result.config.world_size} ranks" if result.config.world_size > 1 else ""
    budget = f"{format_bytes(result.budget_bytes)} on {result.target.name}" + (
        "" if _planned_here(result) else f" ({result.target.device})"
    )
    if result.edited:
        return [
            ("budget", budget),
            ("peak", "not measured for this config: it was edited after tuning"),
            ("throughput", "not measured for this config: `autotune verify` runs it"),
        ]
    if m is None or result.unverified:
        return [
            ("budget", budget),
            ("peak", f"predicted {format_bytes(p.peak_bytes)} per rank, NOT VERIFIED"),
            ("throughput", f"predicted {p.samples_per_s:.1f} samples/s{everyone}, NOT VERIFIED"),
        ]
    return [
        ("budget", budget),
        ("peak", f"predicted {format_bytes(p.peak_bytes)}, measured {format_bytes(m.peak_bytes)}"),
        (
            "throughput",
            f"predicted {p.samples_per_s:.1f}, measured {m.samples_per_s:.1f} samples/s{everyone}",
        ),
        *_against_expert(result),
    ]


def _against_expert(result: TuneResult) -> list[tuple[str, str]]:
    """The row of the expert's recipe, measured in the same run: the config to beat."""
    expert, m = result.expert, result.measured
    if expert is not None and expert.peak_only:  # saved before fallbacks were left out: no speed
        expert = None
    if expert is None and result.expert_note:
        return [("expert's recipe", f"not run: {result.expert_note}")]
    if expert is None or expert.measured is None or m is None:
        return []
    also = f" ({result.expert_note})" if result.expert_note else ""
    if expert.config == result.config:
        return [("expert's recipe", f"this config (nothing measured beat it){also}")]
    speed = expert.measured.samples_per_s
    return [
        (
            "expert's recipe",
            f"{expert.config.describe()}: measured {speed:.1f} samples/s; this config "
            f"{m.samples_per_s / speed:.2f}x{also}",
        )
    ]


def sureness(result: TuneResult) -> list[tuple[str, str]]:
    """(label, text) rows: what of the winner's lead is known, and why not."""
    rows = []
    if result.noise:
        rows.append(("noise", f"a timing is sure to about {100 * result.noise:.1f}% here"))
    if result.tied:
        rows.append(
            (
                "tied",
                f"{len(result.tied)} verified config(s) as fast within that noise (the "
                "simplest won): " + "; ".join(c.describe() for c in result.tied),
            )
        )
    elif result.noise and len(result.trials) > 1:
        rows.append(("tied", "none: the winner's lead is known"))
    if result.busy:
        rows.append(("machine", result.busy))
    return rows
