"""``autotune verify``: run a tuned config (every row of a table per sequence length) on
this device, under its budget, and say whether it fits."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from autotune._format import format_bytes
from autotune._plain_data import to_plain
from autotune.cli._inputs import inputs, optimizer_of
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.result import Measurement, load

__all__ = ["verify"]


@dataclass
class _Run:
    """One config run again: what tuning said of it and what this run measured."""

    length: int | None
    """A table's row (the batch cut to it); ``None``: the one config."""
    config: TrainConfig
    predicted: Measurement | None
    """``None``: the file's config was edited after tuning (the figures are another's)."""
    tuned: Measurement | None
    measured: Measurement | None = None
    error: str | None = None


def verify(args: argparse.Namespace) -> int:
    """Exit code 0: every config fits; 1: one does not."""
    import torch

    from autotune.device import backend_for, discover
    from autotune.train import Workload, differences, refuse_another_model, truncate
    from autotune.verify import Verifier

    result = load(args.path)
    model, batch, loss = inputs(args)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"MODEL must give a torch.nn.Module, got {type(model).__name__}.")
    refuse_another_model(
        result.model,
        model,
        str(args.path),
        "running its config would verify nothing about either: pass the model it was tuned "
        "on, or tune this one.",
    )
    if args.optimizer is not None and optimizer_of(args.optimizer, "--optimizer") != (
        tuned := result.config.optimizer
    ):
        raise ConfigError(f"{args.path} was tuned with optimizer {tuned}, not {args.optimizer}.")
    target = discover(args.device or result.target.device)
    for difference in differences(result, model, target.device):  # device, torch
        print(f"autotune: warning: {difference}", file=sys.stderr)
    runs = [_Run(r.length, r.config, r.predicted, r.measured) for r in result.by_length] or [
        _Run(None, result.config, result.predicted, result.measured)
        if not result.edited
        else _Run(None, result.config, None, None)
    ]
    foreign = backend_for(target.device).foreign_bytes()
    for run in runs:  # a table: each row on the batch cut to its length
        rows = batch if run.length is None else truncate(batch, run.length)
        work = Workload(model, rows, loss, result.model.blocks, target.device, foreign)
        # The buffers a step writes copied before each step, as when tuned.
        verifier = Verifier.of(
            work, result.budget_bytes, target.context_bytes, result.model.written or ()
        )
        run.measured, run.error = verifier.trial(run.config)
    if args.json:  # an object; for a table, a list of them, one per row
        found = [_json(run, str(target.device), result.budget_bytes) for run in runs]
        print(json.dumps(found if result.by_length else found[0], indent=2))
    else:
        for run in runs:
            print(_text(run, target.name, result.budget_bytes))
    return 0 if all(run.measured is not None for run in runs) else 1


def _json(run: _Run, device: str, budget: int) -> dict[str, Any]:
    out = {"fits": run.measured is not None, "device": device, "error": run.error}
    out |= {"budget_bytes": budget, "predicted": to_plain(run.predicted)}  # None: edited
    out |= {"measured": to_plain(run.measured)}
    return out if run.length is None else {"length": run.length, **out}


def _text(run: _Run, name: str, budget: int) -> str:
    at = "" if run.length is None else f" up to length {run.length}"
    edited = "none for this config (edited after tuning)"
    predicted = format_bytes(run.predicted.peak_bytes) if run.predicted else edited
    m = run.measured
    if m is None:
        return (
            f"does not fit  {run.config.describe()}{at} on {name}: {run.error}\n"
            f"              budget {format_bytes(budget)}, predicted {predicted}"
        )
    if run.tuned:
        then = f"; when tuned {format_bytes(run.tuned.peak_bytes)}"
        speed = f"; when tuned {run.tuned.samples_per_s:.1f}"
    elif run.predicted:  # a plan: predicted, never run where it was made
        then, speed = "; not run when planned", ""
    else:
        predicted, then, speed = f"and when tuned: {edited}", "", ""
    return (
        f"fits         {run.config.describe()}{at} on {name}\n"
        f"peak         measured {format_bytes(m.peak_bytes)} within the "
        f"{format_bytes(budget)} budget\n"
        f"             predicted {predicted}{then}\n"
        f"throughput   measured {m.samples_per_s:.1f} samples/s{speed}"
    )
