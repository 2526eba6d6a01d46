"""``autotune plan``: a model planned for a GPU and ranks that are not here (issue 27).

    autotune plan --hf-config config.json --seq-len 4096 --device H100-80GB \\
        --budget-gb 80 --world-size 8 --global-batch 64 -o planned.yaml
    autotune plan mypkg.models:build --batch mypkg.data:sample --device RTX4090-24GB
    autotune plan --hf-config config.json --seq-len 4096 --world-size 64 --trace-rank
    autotune plan --list-devices

MODEL (or ``--hf-config``) is built on fake tensors, so planning an 8B or 70B model takes
seconds of this machine and none of its memory. The plans are printed fastest predicted
first (with ``--trace-rank``, an FSDP2 plan's rank 0 is traced with FSDP2 itself, for its
exact peak per rank); the YAML is a tuned result marked planned (``unverified``), which
``autotune verify`` checks on the real GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from autotune._files import check_writable
from autotune._format import GIB, format_bytes
from autotune.cli._inputs import resolve
from autotune.config import is_factory
from autotune.errors import BudgetTooSmallError, ConfigError
from autotune.result import OTHER, PARTS, TuneResult

__all__ = ["plan"]

_TO_FIT = (
    "more ranks: --world-size 8 shards weights, gradients and optimizer state (FSDP2)",
    "a lighter optimizer: --optimizers adamw,adafactor (or adamw8bit with bitsandbytes)",
    "LoRA: plan the model wrapped with peft adapters (only the adapters train)",
    "shorter sequences: --seq-len",
)


def plan(args: argparse.Namespace) -> int:
    """Run ``autotune plan`` (see the module docstring); 1 where nothing fits."""
    from autotune.device import DEVICES, device_spec

    if args.list_devices:
        for spec in DEVICES.values():
            print(f"{spec.name:<16} {format_bytes(spec.memory_bytes):>10}  {spec.source}")
        return 0
    check_writable(args.output, "-o")
    spec = device_spec(args.device)  # a bad name fails before anything is built
    build, sample, loss = _inputs(args)
    from autotune.cli._commands import space_of
    from autotune.tuning import TuneOptions, plan_with

    options = TuneOptions(
        budget_gb=args.budget_gb if args.budget_gb is not None else spec.memory_bytes / GIB,
        loss_fn=loss,
        global_batch_size=args.global_batch,
        space=space_of(args),
        seed=args.seed,
        world_size=args.world_size,
    )
    started = time.perf_counter()
    try:
        result = plan_with(build, sample, options, spec.name, trace_rank=args.trace_rank)
    except BudgetTooSmallError as exc:
        print(f"autotune: nothing fits: {' '.join(str(exc).split())}")
        print("to fit, try:\n" + "\n".join(f"  - {line}" for line in _TO_FIT))
        return 1
    path = result.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(describe_plan(result, time.perf_counter() - started))
        print(f"\nwritten to {path}; {check_hint(result, str(path))}")
    return 0


def check_hint(result: TuneResult, path: str) -> str:
    """How to check the plan on its GPUs: the command, whole (torchrun for several ranks)."""
    n = result.config.world_size
    name = result.config.optimizer
    yours = f" --optimizer {name}" if is_factory(name) else ""  # a file names it, never runs it
    if n > 1:
        return (
            f"on {n} of those GPUs, `torchrun --nproc-per-node {n} -m autotune.cli tune MODEL "
            f"--batch BATCH --from {path}{yours}` runs it and tunes from it on every rank"
        )
    return f"on that GPU, `autotune verify {path} MODEL --batch BATCH{yours}` runs it"


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(a factory of the model, a sample batch or its factory, the loss) the flags name;
    the factories are called under tracing, by the plan."""
    loss = resolve(args.loss, "--loss", call=False) if args.loss else None
    if args.hf_config:
        if args.model or args.batch:
            raise ConfigError("--hf-config builds the model and its batch: leave MODEL out.")
        if args.seq_len is None:
            raise ConfigError("--hf-config needs --seq-len, the tokens per sample, e.g. 4096.")
        from autotune.integrations.hf_config import causal_lm

        build, sample = causal_lm(args.hf_config, args.seq_len)
        return build, sample, loss
    if not args.model or not args.batch:
        raise ConfigError("plan takes MODEL and --batch (module:attr factories), or --hf-config.")
    build = resolve(args.model, "MODEL", call=False)
    if not callable(build):
        raise ConfigError("MODEL must be a zero-argument factory: plan builds it on fake tensors.")
    return build, resolve(args.batch, "--batch", call=False), loss


def describe_plan(result: TuneResult, seconds: float) -> str:
    """The plans, fastest predicted first, for people."""
    c = result.config
    ranks = f"{c.world_size} x " if c.world_size > 1 else ""
    rate = f"samples/s, all {c.world_size} ranks" if c.world_size > 1 else "samples/s"
    lines = [
        f"planned {result.model.class_name} ({result.model.n_parameters / 1e9:.2f}B parameters) "
        f"for {ranks}{result.target.name}, budget {format_bytes(result.budget_bytes)} per "
        f"rank, in {seconds:.1f} s: NOT VERIFIED",
        "",
        f"   {'plan':<66} {'peak per rank':>14} {rate:>10}",
    ]
    for i, t in enumerate(result.trials, 1):
        p = t.predicted
        lines.append(
            f"{i:>2} {t.config.describe():<66} {format_bytes(p.peak_bytes):>14} "
            f"{p.samples_per_s:>10.2f}"
        )
    b = result.breakdown
    lines.append(
        "\nthe first, at its peak: "
        + ", ".join(f"{n} {format_bytes(getattr(b, n))}" for n in PARTS)
        + f" (other: {OTHER})"
    )
    lines.append("assumed (check on the GPU):")
    lines += [f"  - {note}" for note in result.unverified]
    return "\n".join(lines)
