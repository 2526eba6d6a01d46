"""The ``autotune`` command line: a thin front end over the library.

    autotune tune autotune.models:tiny_gpt --batch autotune.models:example_batch \\
        --budget-gb 0.09 --global-batch 64 -o tuned.yaml
    autotune show tuned.yaml
    autotune estimate MODEL --batch BATCH [--config tuned.yaml] [--micro-batch 8 ...]
    autotune plan --hf-config config.json --seq-len 4096 --device H100-80GB --world-size 8
    autotune verify tuned.yaml MODEL --batch BATCH
    autotune export tuned.yaml --to hf|lightning|deepspeed|accelerate|torchrun [-o FILE]
    autotune report tuned.yaml -o report.html

MODEL, BATCH and LOSS name an object or a zero-argument factory, as
``package.module:attr`` or ``path/to/file.py:attr``. Exit codes: 0 done, 1 the config
does not fit (verify), 2 an error (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, TextIO

from autotune._spelling import spelled_as
from autotune.cli import _commands as commands
from autotune.cli._plan import plan
from autotune.cli._types import FLAGS, gib, positive_int, seconds
from autotune.cli._verify import verify
from autotune.config import PARALLEL, PRECISIONS
from autotune.errors import AutotuneError, AutotuneWarning
from autotune.integrations import TARGETS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    _quiet_threads()
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    with warnings.catch_warnings(), spelled_as(FLAGS):  # the advice names the flags
        warnings.filterwarnings("default", category=AutotuneWarning)
        warnings.filterwarnings("default", module=r"autotune(\.|$)")
        warnings.showwarning = _show_warning
        try:
            return int(args.handler(args))
        except KeyboardInterrupt:
            print("autotune: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # e.g. `autotune show --json | head -1`: the reader left
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # no second error as Python flushes
            return 141  # as a process killed by SIGPIPE
        except Exception as exc:
            if args.traceback:
                raise
            print(f"autotune: error: {_error_line(exc)}", file=sys.stderr)
            return 2


def _quiet_threads() -> None:
    """torch's OpenMP threads wait passively, unless the user said otherwise: spinning,
    they take the cores that other work on a shared machine needs, and the timings with
    them (the quickstart tuned 7.8x slower on a busy 2-core machine). OpenMP reads the
    setting when torch loads, which the commands do after this."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _error_line(exc: Exception) -> str:
    message = " ".join(str(exc).split())  # one line, whatever the message held
    if isinstance(exc, AutotuneError):
        return message
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or message}."
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
    line = " ".join(str(message).split())
    print(f"{clear}autotune: warning: {line}", file=sys.stderr)


# --- the parser ---------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: what was wrong and where help is, no usage block,
    and no abbreviated options (``--budget 0.05`` is an error, not ``--budget-gb``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # subcommands' parsers are made here too
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        return super().parse_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        prog = self.prog
        if message.startswith("unrecognized arguments:"):
            near = self._nearest(message.split(":", 1)[1].split())
            message += f"; did you mean {near}?" if near else ""
            # reported by the top parser for every command: the help to see is the command's
            parsers = self._commands()
            command = next((a for a in getattr(self, "_argv", []) if a in parsers), None)
            prog = f"{prog} {command}" if command else prog
        self.exit(2, f"autotune: error: {message} (see {prog} --help)\n")

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        """The commands' parsers, by name (none for a command's own parser)."""
        found: dict[str, argparse.ArgumentParser] = {}
        for action in self._subparsers._group_actions if self._subparsers else ():
            found.update(getattr(action, "choices", {}) or {})
        return found

    def _nearest(self, words: list[str]) -> str | None:
        """The option, of this parser or its commands', nearest the first unknown one."""
        unknown = next((w.split("=")[0] for w in words if w.startswith("--")), None)
        if unknown is None:
            return None
        options = set(self._option_string_actions)
        for parser in self._commands().values():
            options.update(parser._option_string_actions)
        found = difflib.get_close_matches(unknown, sorted(options), n=1, cutoff=0.6)
        return found[0] if found else None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autotune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    traceback = "on an error, show the traceback (bug reports)"
    parser.add_argument("--traceback", action="store_true", help=traceback)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_tune(sub)  # and show
    _add_estimate(sub)
    _add_plan(sub)
    _add_checks(sub)
    # After the command too, where an error's advice to add it is followed (SUPPRESS: a
    # command's parser leaves the flag given before the command as it was).
    for command in sub.choices.values():
        command.add_argument(
            "--traceback", action="store_true", default=argparse.SUPPRESS, help=traceback
        )
    return parser


def _add_tune(sub: Any) -> None:
    tune = sub.add_parser("tune", help="find the fastest config that fits a memory budget")
    _add_inputs(tune)
    tune.add_argument(
        "--budget-gb", type=gib, help="device memory: 24, 24GiB or 512MiB (required, but --from)"
    )
    tune.add_argument(
        "--from",
        dest="start_from",
        metavar="PLAN",
        help="a plan (autotune plan's YAML) or a tuned YAML: its config verified first, its "
        "budget and global batch the defaults",
    )
    tune.add_argument("--global-batch", type=positive_int, help="samples per optimizer step")
    tune.add_argument(
        "--eval-batch",
        type=positive_int,
        help="the evaluation batch you want, checked beside each config's training state "
        "(default: the largest that fits, measured)",
    )
    tune.add_argument(
        "--global-batch-tokens",
        type=positive_int,
        help="tokens per optimizer step instead: tokens / length samples at each length",
    )
    tune.add_argument(
        "--sequence-lengths",
        help="tune a table, a row per length (the batch at the longest), e.g. 128,256,512",
    )
    tune.add_argument(
        "--trials",
        type=positive_int,
        help="Optuna trials on the cost model, for a space too large to enumerate",
    )
    tune.add_argument("--timeout", type=seconds, help="time limit of the search, seconds")
    tune.add_argument("--max-tuning-time", type=seconds, help="seconds the whole run may take")
    tune.add_argument("--seed", type=int, default=0, help="seed of the study (default 0)")
    _add_space(tune)
    tune.add_argument(
        "--world-size",
        type=positive_int,
        help="ranks to train on with DDP/FSDP2: under torchrun, the group's size (default); "
        "in one process, plan that many without running them",
    )
    tune.add_argument("--storage", help="keep the study: sqlite:///tune.db, a *.journal file...")
    tune.add_argument("--study", help="name of the study in --storage")
    tune.add_argument("-o", "--output", default="tuned.yaml", help="result file (tuned.yaml)")
    tune.add_argument("--json", action="store_true", help="print the result as JSON")
    tune.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    tune.set_defaults(handler=commands.tune_command)

    show = sub.add_parser("show", help="print a tuned YAML file for people")
    show.add_argument("path", help="a tuned YAML file")
    show.add_argument("--json", action="store_true", help="print as JSON")
    show.set_defaults(handler=commands.show)


def _add_plan(sub: Any) -> None:
    plan_parser = sub.add_parser(
        "plan",
        help="plan a model for a GPU and ranks that are not here (no GPU needed)",
        description="Build the model on fake tensors (no memory), trace its training "
        "steps and plan it for a GPU of the table and a number of ranks: the plans "
        "fastest predicted first, their peak per rank, and a YAML marked planned. "
        "Time is a roofline on the GPU's datasheet: NOT VERIFIED. Exit 1 if nothing fits.",
    )
    plan_parser.add_argument(
        "model", nargs="?", metavar="MODEL", help="module:attr of a zero-argument model factory"
    )
    plan_parser.add_argument(
        "--batch", help="module:attr of a sample batch, or of a factory of one"
    )
    plan_parser.add_argument("--loss", help="module:attr of loss_fn(output, batch) -> scalar")
    plan_parser.add_argument(
        "--hf-config", help="a Hugging Face config.json: the model, no weights"
    )
    plan_parser.add_argument("--seq-len", type=positive_int, help="tokens per sample (--hf-config)")
    plan_parser.add_argument(
        "--device", default="H100-80GB", help="the GPU by name (default H100-80GB; --list-devices)"
    )
    plan_parser.add_argument(
        "--list-devices", action="store_true", help="the table of GPUs, and exit"
    )
    plan_parser.add_argument("--budget-gb", type=gib, help="memory per rank (default: the GPU's)")
    plan_parser.add_argument("--global-batch", type=positive_int, help="samples per optimizer step")
    plan_parser.add_argument(
        "--world-size", type=positive_int, help="ranks: DDP or FSDP2 (default 1)"
    )
    plan_parser.add_argument("--seed", type=int, default=0, help="seed of the search (default 0)")
    plan_parser.add_argument(
        "--trace-rank",
        action="store_true",
        help="an FSDP2 plan: trace its rank 0 with FSDP2 itself, for the exact peak per rank "
        "(a traced step of the whole model: a minute for an 8B)",
    )
    _add_space(plan_parser, gpu_knobs=False)
    plan_parser.add_argument(
        "-o", "--output", default="planned.yaml", help="result file (planned.yaml)"
    )
    plan_parser.add_argument("--json", action="store_true", help="print the result as JSON")
    plan_parser.set_defaults(
        handler=plan, offload="off", compile="off", compile_model="off", chunked_loss="off"
    )


def _add_space(tune: Any, *, gpu_knobs: bool = True) -> None:
    """The flags of ``tune`` that narrow or widen the search space."""
    tune.add_argument(
        "--optimizers",
        help="optimizers to search, the user's first: e.g. adamw,adamw8bit (default adamw: "
        "searched as adamw_fused where torch has the fused kernel)",
    )
    tune.add_argument(
        "--optimizer",
        metavar="MODULE:FACTORY",
        help="your optimizer: a function of the trainable parameters (or of the model, its "
        "first parameter named model) returning a torch.optim.Optimizer, in place of adamw; "
        "the YAML records its path, and autotune.prepare(..., optimizer=) takes it again",
    )
    tune.add_argument(
        "--precisions",
        help=f"precisions to search, e.g. bf16,fp32 (default {','.join(PRECISIONS)})",
    )
    tune.add_argument(
        "--micro-batch-sizes", help="only these micro-batch sizes, e.g. 8,16,32 (default: any)"
    )
    tune.add_argument(
        "--blocks", help="the blocks to checkpoint or offload, NAME,NAME (default: found)"
    )
    tune.add_argument("--no-checkpointing", action="store_true", help="never checkpoint a block")
    tune.add_argument(
        "--no-selective-checkpointing",
        action="store_true",
        help="checkpoint blocks whole only, never keeping their matrix products",
    )
    if not gpu_knobs:  # offload, compiling and the chunked loss: not planned on fake tensors
        return
    tune.add_argument(
        "--offload",
        choices=("auto", "on", "off"),
        default="auto",
        help="search optimizer and activation offload (auto: on CUDA only)",
    )
    tune.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="search compiled blocks, torch.compile of each block (auto: on CUDA only)",
    )
    tune.add_argument(
        "--compile-model",
        choices=("auto", "on", "off"),
        default="auto",
        help="search the whole model compiled with its loss, shapes static (auto: on CUDA only)",
    )
    tune.add_argument(
        "--chunked-loss",
        choices=("auto", "on", "off"),
        default="auto",
        help="search a causal LM's loss in chunks, never the whole logits (auto: where the "
        "logits are a quarter of a sample's memory or more)",
    )


def _add_checks(sub: Any) -> None:
    """The commands that use a tuned YAML file: verify, export, report."""
    ver = sub.add_parser(
        "verify",
        help="run a tuned config on this machine: exit 0 if it fits, 1 if not",
        description="Train a few steps with the tuned config under its budget and measure "
        "the peak. Exit 0 if it fits the budget, 1 if it does not, 2 on bad input.",
    )
    ver.add_argument("path", help="a tuned YAML file")
    _add_inputs(ver, device_help="where to run (default: the device it was tuned on)")
    ver.add_argument(
        "--optimizer",
        metavar="MODULE:FACTORY",
        help="the optimizer factory a config was tuned with (its path is in the file)",
    )
    ver.add_argument("--json", action="store_true", help="print as JSON")
    ver.set_defaults(handler=verify)

    exp = sub.add_parser("export", help="a tuned config as another trainer's settings")
    exp.add_argument("path", help="a tuned YAML file")
    exp.add_argument("--to", required=True, choices=TARGETS)
    exp.add_argument("-o", "--output", help="file to write (default: stdout)")
    exp.set_defaults(handler=commands.export_command)

    rep = sub.add_parser("report", help="an HTML page (or PNG) of the trials and the memory")
    rep.add_argument("path", help="a tuned YAML file")
    rep.add_argument("-o", "--output", default="report.html", help="*.html or *.png")
    rep.set_defaults(handler=commands.report)


def _add_estimate(sub: Any) -> None:
    est = sub.add_parser(
        "estimate",
        help="predicted peak memory of one config, without tuning",
        description="Profile the memory of two small training steps on the device and "
        "predict the peak of one configuration, split by owner. Knob flags override "
        "--config; nothing is timed or verified.",
    )
    _add_inputs(est)
    est.add_argument("--config", help="take the knobs from a tuned YAML file")
    est.add_argument("--micro-batch", type=positive_int, help="samples per forward/backward")
    est.add_argument("--accum", type=positive_int, help="micro-batches per optimizer step")
    est.add_argument("--precision", choices=PRECISIONS)
    est.add_argument("--checkpoint", help="blocks to checkpoint: all, none, or a comma list")
    est.add_argument(
        "--selective-checkpoint",
        help="blocks to checkpoint selectively (matrix products kept): all, none, or a list",
    )
    est.add_argument(
        "--compile-blocks",
        choices=("all", "none"),
        help="blocks to run compiled (torch.compile of each block's forward): all or none",
    )
    est.add_argument(
        "--compile-model",
        action="store_true",
        help="the whole model and its loss compiled as one graph (not with --compile-blocks)",
    )
    est.add_argument(
        "--chunked-loss",
        action="store_true",
        help="a causal LM's output layer and loss in chunks of the tokens",
    )
    est.add_argument(
        "--optimizer",
        help="adamw, adamw_fused, adamw8bit, paged_adamw8bit, paged_adamw, adafactor, sgd, "
        "or your factory MODULE:FACTORY (as for tune)",
    )
    est.add_argument(
        "--offload-activations", help="blocks to offload to the host: all, none, or a comma list"
    )
    est.add_argument(
        "--offload-optimizer", action="store_true", help="optimizer state and step on the host"
    )
    est.add_argument("--parallel", choices=PARALLEL, help="data parallelism (default none)")
    est.add_argument(
        "--world-size", type=positive_int, help="ranks to predict one rank's peak for (fsdp)"
    )
    est.add_argument(
        "--keep-gathered", help="FSDP units not resharded after forward: all, none or a list"
    )
    est.add_argument("--json", action="store_true", help="print as JSON")
    est.set_defaults(handler=commands.estimate_command)


def _add_inputs(parser: argparse.ArgumentParser, *, device_help: str | None = None) -> None:
    parser.add_argument("model", metavar="MODEL", help="module:attr or file.py:attr of a model")
    parser.add_argument("--batch", required=True, help="module:attr of a sample batch")
    parser.add_argument("--loss", help="module:attr of loss_fn(output, batch) -> scalar")
    parser.add_argument(
        "--device", help=device_help or "cuda, cuda:N or cpu (default: cuda if available)"
    )
