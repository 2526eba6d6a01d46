"""The ``autotune`` command line: a thin front end over the library.

    autotune tune autotune.models:tiny_gpt --batch autotune.models:example_batch \\
        --budget-gb 0.09 --global-batch 64 -o tuned.yaml
    autotune show tuned.yaml

MODEL, BATCH and LOSS name an object or a zero-argument factory, as
``package.module:attr`` or ``path/to/file.py:attr``. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import TuneResult, load
from .errors import AutotuneError, ConfigError
from .target import format_bytes

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input or no fit)."""
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except AutotuneError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    tune = sub.add_parser("tune", help="find the fastest config that fits a memory budget")
    tune.add_argument("model", help="module:attr of a model or a zero-argument factory")
    tune.add_argument("--batch", required=True, help="module:attr of a sample batch or factory")
    tune.add_argument("--budget-gb", type=float, required=True, help="device memory, GiB")
    tune.add_argument("--loss", help="module:attr of loss_fn(output, batch) -> scalar")
    tune.add_argument("--global-batch", type=int, help="samples per optimizer step")
    tune.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    tune.add_argument("--trials", type=int, help="Optuna trials on the cost model")
    tune.add_argument("--timeout", type=float, help="time limit of the search, seconds")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--storage", help="Optuna storage URL to keep the study")
    tune.add_argument("-o", "--output", default="tuned.yaml", help="where to write the result")
    tune.add_argument("--json", action="store_true", help="print the result as JSON")
    tune.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    tune.set_defaults(run=_tune)

    show = sub.add_parser("show", help="print a tuned YAML file for people")
    show.add_argument("path")
    show.add_argument("--json", action="store_true", help="print as JSON")
    show.set_defaults(run=_show)
    return parser


def _tune(args: argparse.Namespace) -> int:
    from .tune import autotune

    if not args.quiet:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("  %(message)s"))
        logger = logging.getLogger("autotune")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    model = _resolve(args.model, "MODEL")
    batch = _resolve(args.batch, "--batch")
    loss = _resolve(args.loss, "--loss", call=False) if args.loss else None
    result = autotune(
        model,
        batch,
        args.budget_gb,
        loss_fn=loss,
        global_batch_size=args.global_batch,
        device=args.device,
        n_trials=args.trials,
        timeout_s=args.timeout,
        seed=args.seed,
        storage=args.storage,
    )
    path = result.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(_describe(result))
        print(f"\nwritten to {path}")
    return 0


def _show(args: argparse.Namespace) -> int:
    result = load(args.path)
    print(json.dumps(result.to_dict(), indent=2) if args.json else _describe(result))
    return 0


def _describe(result: TuneResult) -> str:
    c, p, m, b = result.config, result.predicted, result.measured, result.breakdown
    lines = [
        f"config      {c.describe()}",
        f"            effective batch {c.effective_batch_size}; checkpoint: "
        + (", ".join(c.checkpoint) or "none"),
        f"budget      {format_bytes(result.budget_bytes)} on {result.target.name} "
        f"({result.target.device})",
        f"peak        predicted {format_bytes(p.peak_bytes)}, "
        f"measured {format_bytes(m.peak_bytes)}",
        f"throughput  predicted {p.samples_per_s:.1f}, measured {m.samples_per_s:.1f} samples/s",
        "memory      "
        + ", ".join(
            f"{name} {format_bytes(getattr(b, name))}"
            for name in ("parameters", "gradients", "optimizer", "activations", "other")
        ),
    ]
    for i, f in enumerate(result.fallbacks, 1):
        lines.append(f"fallback {i}  {f.describe()}")
    lines.append(f"tuned in    {result.tuning_s:.1f} s; {len(result.trials)} configs run for real")
    return "\n".join(lines)


def _resolve(spec: str, what: str, *, call: bool = True) -> Any:
    """Import ``module:attr`` or ``file.py:attr``; call it if it is a zero-argument factory."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(
            f"{what} must look like package.module:attr or path/file.py:attr, got {spec!r}."
        )
    try:
        if target.endswith(".py"):
            file = Path(target)
            module_spec = importlib.util.spec_from_file_location(file.stem, file)
            if module_spec is None or module_spec.loader is None or not file.exists():
                raise ConfigError(f"{what}: no Python file at {target!r}.")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {target!r}: {exc}.") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{what}: {target!r} has no attribute {attr!r}.")
    obj = getattr(module, attr)
    import torch

    if call and callable(obj) and not isinstance(obj, torch.nn.Module):
        obj = obj()
    return obj


if __name__ == "__main__":
    raise SystemExit(main())
