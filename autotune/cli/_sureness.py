"""How sure a result is, in words: the timing noise, the configs tied with the winner,
and a busy machine; what ``tune``, ``show`` and the report print."""

from __future__ import annotations

from autotune.result import TuneResult

__all__ = ["sureness"]


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
