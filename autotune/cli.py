"""The ``autotune`` command line: a thin front end over the library.

    autotune tune autotune.models:tiny_gpt --batch autotune.models:example_batch \\
        --budget-gb 0.09 --global-batch 64 -o tuned.yaml
    autotune show tuned.yaml
    autotune estimate MODEL --batch BATCH [--config tuned.yaml] [--micro-batch 8 ...]
    autotune verify tuned.yaml MODEL --batch BATCH
    autotune export tuned.yaml --to hf|lightning|deepspeed|accelerate [-o FILE]
    autotune report tuned.yaml -o report.html

MODEL, BATCH and LOSS name an object or a zero-argument factory, as
``package.module:attr`` or ``path/to/file.py:attr``. Exit codes: 0 done, 1 the config
does not fit (verify), 2 an error (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from .config import PRECISIONS, TrainConfig, TuneResult, load, to_plain
from .errors import AutotuneError, AutotuneWarning, ConfigError
from .progress import progress
from .space import SearchSpace
from .target import format_bytes

__all__ = ["main"]

_PARTS = ("parameters", "gradients", "optimizer", "activations", "other")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    with warnings.catch_warnings():
        warnings.filterwarnings("default", category=AutotuneWarning)
        warnings.filterwarnings("default", module=r"autotune(\.|$)")
        warnings.showwarning = _show_warning
        try:
            return int(args.run(args))
        except KeyboardInterrupt:
            print("autotune: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:
            if args.traceback:
                raise
            print(f"autotune: error: {_error_line(exc)}", file=sys.stderr)
            return 2


def _error_line(exc: Exception) -> str:
    message = " ".join(str(exc).split())  # one line, whatever the message held
    if isinstance(exc, AutotuneError):
        return message
    return f"{type(exc).__name__}: {message} (run with --traceback for details)"


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A warning as one line on stderr (clearing a progress bar first on a terminal)."""
    clear = "\r\033[K" if sys.stderr.isatty() else ""
    print(f"{clear}autotune: warning: {' '.join(str(message).split())}", file=sys.stderr)


# --- the parser ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traceback", action="store_true", help="on an error, show the traceback (bug reports)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tune = sub.add_parser("tune", help="find the fastest config that fits a memory budget")
    _add_inputs(tune)
    tune.add_argument("--budget-gb", type=float, required=True, help="device memory, GiB")
    tune.add_argument("--global-batch", type=int, help="samples per optimizer step")
    tune.add_argument("--trials", type=int, help="Optuna trials on the cost model")
    tune.add_argument("--timeout", type=float, help="time limit of the search, seconds")
    tune.add_argument("--seed", type=int, default=0, help="seed of the study (default 0)")
    tune.add_argument(
        "--optimizers",
        help="optimizers to search, the user's first: e.g. adamw,adamw8bit (default adamw)",
    )
    tune.add_argument(
        "--offload",
        choices=("auto", "on", "off"),
        default="auto",
        help="search optimizer and activation offload (auto: on CUDA only)",
    )
    tune.add_argument("--storage", help="keep the study: sqlite:///tune.db, a *.journal file...")
    tune.add_argument("--study", help="name of the study in --storage")
    tune.add_argument("-o", "--output", default="tuned.yaml", help="result file (tuned.yaml)")
    tune.add_argument("--json", action="store_true", help="print the result as JSON")
    tune.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    tune.set_defaults(run=_tune)

    show = sub.add_parser("show", help="print a tuned YAML file for people")
    show.add_argument("path", help="a tuned YAML file")
    show.add_argument("--json", action="store_true", help="print as JSON")
    show.set_defaults(run=_show)

    est = sub.add_parser(
        "estimate",
        help="predicted peak memory of one config, without tuning",
        description="Profile the memory of two small training steps on the device and "
        "predict the peak of one configuration, split by owner. Knob flags override "
        "--config; nothing is timed or verified.",
    )
    _add_inputs(est)
    est.add_argument("--config", help="take the knobs from a tuned YAML file")
    est.add_argument("--micro-batch", type=int, help="samples per forward/backward")
    est.add_argument("--accum", type=int, help="micro-batches per optimizer step")
    est.add_argument("--precision", choices=PRECISIONS)
    est.add_argument("--checkpoint", help="blocks to checkpoint: all, none, or a comma list")
    est.add_argument("--optimizer", help="adamw, adamw8bit, adafactor or sgd")
    est.add_argument(
        "--offload-activations", help="blocks to offload to the host: all, none, or a comma list"
    )
    est.add_argument(
        "--offload-optimizer", action="store_true", help="optimizer state and step on the host"
    )
    est.add_argument("--json", action="store_true", help="print as JSON")
    est.set_defaults(run=_estimate)

    ver = sub.add_parser(
        "verify",
        help="run a tuned config on this machine: exit 0 if it fits, 1 if not",
        description="Train a few steps with the tuned config under its budget and measure "
        "the peak. Exit 0 if it fits the budget, 1 if it does not, 2 on bad input.",
    )
    ver.add_argument("path", help="a tuned YAML file")
    _add_inputs(ver, device_help="where to run (default: the device it was tuned on)")
    ver.add_argument("--json", action="store_true", help="print as JSON")
    ver.set_defaults(run=_verify)

    exp = sub.add_parser("export", help="a tuned config as another trainer's settings")
    exp.add_argument("path", help="a tuned YAML file")
    exp.add_argument("--to", required=True, choices=("hf", "lightning", "deepspeed", "accelerate"))
    exp.add_argument("-o", "--output", help="file to write (default: stdout)")
    exp.set_defaults(run=_export)

    rep = sub.add_parser("report", help="an HTML page (or PNG) of the trials and the memory")
    rep.add_argument("path", help="a tuned YAML file")
    rep.add_argument("-o", "--output", default="report.html", help="*.html or *.png")
    rep.set_defaults(run=_report)
    return parser


def _add_inputs(parser: argparse.ArgumentParser, *, device_help: str | None = None) -> None:
    parser.add_argument("model", metavar="MODEL", help="module:attr or file.py:attr of a model")
    parser.add_argument("--batch", required=True, help="module:attr of a sample batch")
    parser.add_argument("--loss", help="module:attr of loss_fn(output, batch) -> scalar")
    parser.add_argument(
        "--device", help=device_help or "cuda, cuda:N or cpu (default: cuda if available)"
    )


# --- the commands ----------------------------------------------------------------------


def _tune(args: argparse.Namespace) -> int:
    from .tune import autotune

    model, batch, loss = _inputs(args)
    extra: dict[str, Any] = {}
    if args.study is not None:
        if "study_name" not in inspect.signature(autotune).parameters:
            raise ConfigError("--study needs an autotune() that takes study_name.")
        extra["study_name"] = args.study
    offload = {"auto": None, "on": True, "off": False}[args.offload]
    space = SearchSpace(
        optimizers=tuple(args.optimizers.split(",")) if args.optimizers else ("adamw",),
        offload_optimizer=offload,
        offload_activations=offload,
    )
    with progress(quiet=args.quiet):
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
            space=space,
            **extra,
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


def _estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate
    from .target import discover

    model, batch, loss = _inputs(args)
    config, blocks = TrainConfig(), None
    if args.config:
        result = load(args.config)
        config, blocks = result.config, (result.model.blocks or None)
    knobs = {
        "micro_batch_size": args.micro_batch,
        "grad_accum_steps": args.accum,
        "precision": args.precision,
        "optimizer": args.optimizer,
    }
    if args.checkpoint is not None:
        knobs["checkpoint"] = _checkpoint(args.checkpoint, model, blocks)
    if args.offload_activations is not None:
        knobs["offload_activations"] = _checkpoint(args.offload_activations, model, blocks)
    if args.offload_optimizer:
        knobs["offload_optimizer"] = True
    config = config.replace(**{k: v for k, v in knobs.items() if v is not None})
    peak, parts = estimate(model, batch, config, device=args.device, loss_fn=loss, blocks=blocks)
    target = discover(args.device)
    if args.json:
        out = {"config": to_plain(config), "device": str(target.device), "peak_bytes": peak}
        print(json.dumps({**out, "breakdown": to_plain(parts)}, indent=2))
        return 0
    print(f"config       {config.describe()} (effective batch {config.effective_batch_size})")
    print(f"checkpoint   {', '.join(config.checkpoint) or 'none'}")
    if config.offload_activations or config.offload_optimizer:
        print(f"offloaded    {', '.join(config.offload_activations) or 'no blocks'}", end="")
        print(", optimizer on the host" if config.offload_optimizer else "")
    print(f"device       {target.name} ({target.device})")
    print(f"peak         {format_bytes(peak)} predicted")
    for name in _PARTS:
        value = getattr(parts, name)
        print(f"  {name:<11}{format_bytes(value):>12}  {100 * value / max(peak, 1):5.1f}%")
    return 0


def _verify(args: argparse.Namespace) -> int:
    import torch

    from .identity import differences
    from .target import discover
    from .verify import Verifier

    result = load(args.path)
    model, batch, loss = _inputs(args)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"MODEL must give a torch.nn.Module, got {type(model).__name__}.")
    target = discover(args.device or result.target.device)
    for difference in differences(result, model, target.device):
        print(f"autotune: warning: {difference}", file=sys.stderr)
    cuda = target.device.type == "cuda"
    verifier = Verifier(
        model,
        batch,
        device=target.device,
        budget_bytes=result.budget_bytes,
        loss_fn=loss,
        context_bytes=target.context_bytes,
        foreign_bytes=torch.cuda.memory_allocated(target.device) if cuda else 0,
    )
    measured, error = verifier.run(result.config)
    budget, predicted = result.budget_bytes, result.predicted
    if args.json:
        out = {"fits": measured is not None, "device": str(target.device), "error": error}
        out |= {"budget_bytes": budget, "predicted": to_plain(predicted)}
        print(json.dumps({**out, "measured": to_plain(measured)}, indent=2))
    elif measured is None:
        print(f"does not fit  {result.config.describe()} on {target.name}: {error}")
        print(f"              budget {format_bytes(budget)}, predicted {_peak(predicted)}")
    else:
        print(f"fits         {result.config.describe()} on {target.name}")
        print(f"peak         measured {_peak(measured)} within the {format_bytes(budget)} budget")
        print(f"             predicted {_peak(predicted)}; when tuned {_peak(result.measured)}")
        print(
            f"throughput   measured {measured.samples_per_s:.1f} samples/s; "
            f"when tuned {result.measured.samples_per_s:.1f}"
        )
    return 0 if measured is not None else 1


def _export(args: argparse.Namespace) -> int:
    from .export import export

    exported = export(load(args.path), args.to)
    for warning in exported.warnings:
        print(f"autotune: warning: {warning}", file=sys.stderr)
    if args.output is None:
        sys.stdout.write(exported.text)
    else:
        Path(args.output).write_text(exported.text)
        print(f"written to {args.output}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    path = write_report(load(args.path), args.output)
    print(f"written to {path}")
    return 0


# --- helpers ---------------------------------------------------------------------------


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
        "memory      " + ", ".join(f"{name} {format_bytes(getattr(b, name))}" for name in _PARTS),
    ]
    for i, f in enumerate(result.fallbacks, 1):
        lines.append(f"fallback {i}  {f.describe()}")
    lines.append(f"tuned in    {result.tuning_s:.1f} s; {len(result.trials)} configs run for real")
    return "\n".join(lines)


def _peak(measurement: Any) -> str:
    return format_bytes(measurement.peak_bytes)


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The model, the sample batch and the loss function named on the command line."""
    model = _resolve(args.model, "MODEL")
    batch = _resolve(args.batch, "--batch")
    loss = _resolve(args.loss, "--loss", call=False) if args.loss else None
    return model, batch, loss


def _checkpoint(spec: str, model: Any, blocks: Sequence[str] | None) -> tuple[str, ...]:
    """``--checkpoint``: ``all`` (every block), ``none``, or block names separated by commas."""
    if spec.strip() == "none":
        return ()
    if spec.strip() == "all":
        from .blocks import resolve_blocks

        return resolve_blocks(model, blocks)
    return tuple(name.strip() for name in spec.split(",") if name.strip())


def _resolve(spec: str, what: str, *, call: bool = True) -> Any:
    """Import ``module:attr`` or ``file.py:attr``; call it if it is a zero-argument factory."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(
            f"{what} must look like package.module:attr or path/file.py:attr, got {spec!r}."
        )
    module = _import(target, what)
    if not hasattr(module, attr):
        raise ConfigError(f"{what}: {target!r} has no attribute {attr!r}.")
    obj = getattr(module, attr)
    import torch

    if call and callable(obj) and not isinstance(obj, torch.nn.Module):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigError(f"{what}: {spec}() failed: {type(exc).__name__}: {exc}") from exc
    return obj


def _import(target: str, what: str) -> Any:
    """A module by dotted name (the working directory first on the path) or by file."""
    try:
        if not target.endswith(".py"):
            with _cwd_on_path():
                return importlib.import_module(target)
        file = Path(target)
        module_spec = importlib.util.spec_from_file_location(file.stem, file)
        if module_spec is None or module_spec.loader is None or not file.is_file():
            raise ConfigError(f"{what}: no Python file at {target!r}.")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {target!r}: {exc}.") from None
    except AutotuneError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{what}: importing {target!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    """``module:attr`` finds modules in the working directory, as ``python -m`` would."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


# --- progress --------------------------------------------------------------------------


if __name__ == "__main__":
    raise SystemExit(main())
