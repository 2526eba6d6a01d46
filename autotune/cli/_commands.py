"""The commands of the ``autotune`` command line, one function each (see ``_main``).

``autotune tune`` under ``torchrun``: join the process group it describes, and leave it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autotune._files import check_writable, write_atomic
from autotune._format import GIB, format_bytes
from autotune._plain_data import to_plain
from autotune.cli._figures import figures, sureness
from autotune.cli._inputs import inputs, optimizer_of
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.result import OTHER, PARTS, PLANNED, Costs, LengthRow, TrialRecord, TuneResult, load
from autotune.space import SearchSpace

if TYPE_CHECKING:
    from autotune.tuning import Estimate, TuneOptions
import contextlib
from collections.abc import Iterator

__all__ = [
    "estimate_command",
    "export_command",
    "join_torchrun",
    "leave_group",
    "report",
    "show",
    "space_of",
    "tune_command",
]


def tune_command(args: argparse.Namespace) -> int:
    check_writable(args.output, "-o")  # before minutes of tuning, and before torch loads
    plan = load(args.start_from) if args.start_from else None
    if args.budget_gb is None and plan is None:
        raise ConfigError("tune needs --budget-gb (e.g. --budget-gb 24), or --from a plan.")
    model, batch, loss = inputs(args)  # a module that is not there: said before torch loads
    from autotune import tuning

    lengths = args.sequence_lengths
    options = _options(
        args, loss, _integers(lengths, "--sequence-lengths") if lengths else None, plan
    )
    first, joined = join_torchrun(args.device)
    with tuning.showing_progress(quiet=args.quiet or not first), leave_group(joined):
        result = tuning.tune(model, batch, options)
    if not first:  # every rank has the same result; rank 0 writes and prints it
        return 0
    path = result.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(_describe(result))
        if plan is not None:
            print(_against_plan(result, plan))
        print(f"\nwritten to {path}")
    return 0


def _against_plan(result: TuneResult, plan: TuneResult) -> str:
    """What the plan predicted for its config against what the device measured."""
    from autotune.tuning import plan_record

    record = plan_record(result, plan)
    head = f"the plan    {plan.config.describe()}: "
    if record is None:
        return head + "not run"
    p = record.predicted
    if record.measured is None:
        return head + f"predicted {format_bytes(p.peak_bytes)}, rejected: {record.error}"
    m = record.measured
    error = (p.peak_bytes - m.peak_bytes) / m.peak_bytes
    won = "; it won" if record.config == result.config else ""
    return head + (
        f"peak predicted {format_bytes(p.peak_bytes)}, measured {format_bytes(m.peak_bytes)} "
        f"({error:+.1%}); {p.samples_per_s:.1f} samples/s predicted, {m.samples_per_s:.1f} "
        f"measured{won}"
    )


def _options(
    args: argparse.Namespace,
    loss: Any,
    lengths: tuple[int, ...] | None,
    plan: TuneResult | None,
) -> TuneOptions:
    """The tuner's options the flags of ``tune`` describe, starting from ``plan`` (its
    budget where ``--budget-gb`` is left out)."""
    from autotune.tuning import TuneOptions

    budget = args.budget_gb
    if budget is None and plan is not None:
        budget = plan.budget_bytes / GIB
    return TuneOptions(
        budget_gb=budget,
        start_from=plan,
        loss_fn=loss,
        global_batch_size=args.global_batch,
        global_batch_tokens=args.global_batch_tokens,
        sequence_lengths=lengths,
        device=args.device,
        space=space_of(args),
        n_trials=args.trials,
        timeout_s=args.timeout,
        max_tuning_s=args.max_tuning_time,
        seed=args.seed,
        storage=args.storage,
        study_name=args.study,
        world_size=args.world_size,
        progress=False,  # the command shows its own (plain lines off a terminal), or none
        eval_batch_size=args.eval_batch,
    )


def space_of(args: argparse.Namespace) -> SearchSpace:
    """The search space the flags of ``tune`` describe."""
    from autotune.tuning import with_optimizer

    offload = {"auto": None, "on": True, "off": False}[args.offload]
    knobs: dict[str, Any] = {
        "optimizers": tuple(optimizer_of(o, "--optimizers") for o in _names(args.optimizers))
        or ("adamw",),
        "offload_optimizer": offload,
        "offload_activations": offload,
        "checkpointing": not args.no_checkpointing,
        "selective_checkpointing": not args.no_selective_checkpointing,
        "compile_blocks": {"auto": None, "on": True, "off": False}[args.compile],
        "compile_model": {"auto": None, "on": True, "off": False}[args.compile_model],
        "chunked_loss": {"auto": None, "on": True, "off": False}[args.chunked_loss],
    }
    if args.precisions:
        knobs["precisions"] = _names(args.precisions)
    if args.blocks:
        knobs["blocks"] = _names(args.blocks)
    if args.micro_batch_sizes:
        knobs["micro_batch_sizes"] = _integers(args.micro_batch_sizes, "--micro-batch-sizes")
    space = SearchSpace(**knobs)
    return with_optimizer(space, args.optimizer and optimizer_of(args.optimizer, "--optimizer"))


def _integers(text: str, flag: str) -> tuple[int, ...]:
    """A flag's integers, separated by commas."""
    try:
        return tuple(int(s) for s in _names(text))
    except ValueError:
        raise ConfigError(
            f"{flag} takes integers separated by commas, e.g. 8,16,32; got {text[:40]!r}."
        ) from None


def _names(text: str | None) -> tuple[str, ...]:
    """The comma-separated names of a flag's value, blanks dropped."""
    return tuple(s.strip() for s in text.split(",") if s.strip()) if text else ()


def show(args: argparse.Namespace) -> int:
    result = load(args.path)
    print(json.dumps(result.to_dict(), indent=2) if args.json else _describe(result))
    return 0


def estimate_command(args: argparse.Namespace) -> int:
    from autotune.device import discover
    from autotune.tuning import estimate

    model, batch, loss = inputs(args)
    config, blocks = TrainConfig(), None
    if args.config:
        result = load(args.config)
        config, blocks = result.config, (result.model.blocks or None)
    knobs = {
        "micro_batch_size": args.micro_batch,
        "grad_accum_steps": args.accum,
        "precision": args.precision,
        "optimizer": args.optimizer and optimizer_of(args.optimizer, "--optimizer"),
    }
    if args.checkpoint is not None:
        knobs["checkpoint"] = _checkpoint(args.checkpoint, model, blocks)
    if args.selective_checkpoint is not None:
        knobs["selective_checkpoint"] = _checkpoint(args.selective_checkpoint, model, blocks)
    if args.offload_activations is not None:
        knobs["offload_activations"] = _checkpoint(args.offload_activations, model, blocks)
    if args.compile_blocks is not None:
        knobs["compile_blocks"] = _checkpoint(args.compile_blocks, model, blocks)
    if args.compile_model:
        knobs["compile_model"] = True
    if args.chunked_loss:
        knobs["chunked_loss"] = True
    if args.offload_optimizer:
        knobs["offload_optimizer"] = True
    if args.parallel is not None:
        knobs["parallel"] = args.parallel
    if args.world_size is not None:
        knobs["world_size"] = args.world_size
        if args.parallel is None and config.parallel == "none" and args.world_size > 1:
            knobs["parallel"] = "fsdp"
    if args.keep_gathered is not None:
        knobs["keep_gathered"] = _checkpoint(args.keep_gathered, model, blocks)
    config = config.replace(**{k: v for k, v in knobs.items() if v is not None})
    found = estimate(model, batch, config, device=args.device, loss_fn=loss, blocks=blocks)
    target = discover(args.device)
    if args.json:
        out = {"config": to_plain(config), "device": str(target.device)}
        out |= {"peak_bytes": found.peak_bytes, "breakdown": to_plain(found.at_peak)}
        print(json.dumps(out | {"costs": to_plain(found.costs)}, indent=2))
    else:
        print(_estimated(config, found, f"{target.name} ({target.device})"))
    return 0


def _estimated(config: TrainConfig, found: Estimate, device: str) -> str:
    """``autotune estimate``'s text: the config, its peak, what holds it, what each costs."""
    peak, parts = found
    lines = [
        f"config       {config.describe()} (effective batch {config.effective_batch_size})",
        f"checkpoint   {', '.join(config.checkpoint) or 'none'}",
    ]
    if config.selective_checkpoint:
        lines.append(f"selective    {', '.join(config.selective_checkpoint)}")
    if config.offload_activations or config.offload_optimizer:
        lines.append(
            f"offloaded    {', '.join(config.offload_activations) or 'no blocks'}"
            + (", optimizer on the host" if config.offload_optimizer else "")
        )
    lines.append(f"device       {device}")
    if config.world_size > 1:
        lines.append(
            f"peak         {format_bytes(peak)} predicted per rank of {config.world_size} "
            f"({config.parallel}; planned in one process, the collectives' buffers of the "
            "backend are not in it)"
        )
    else:
        lines.append(f"peak         {format_bytes(peak)} predicted")
    lines.append("at the peak  what holds memory at that moment")
    for name in PARTS:
        value = getattr(parts, name)
        lines.append(f"  {name:<15}{format_bytes(value):>12}  {100 * value / max(peak, 1):5.1f}%")
    if found.costs is not None and found.costs.gradients and not parts.gradients:
        lines.append("  (the peak comes in the first forward, before the backward makes gradients)")
    if found.costs is not None:
        lines += _costs(found.costs)
    return "\n".join(lines)


def _costs(c: Costs) -> list[str]:
    """What each part costs at its own most, and what grows with the micro-batch."""
    rows = [
        ("parameters", c.parameters, ""),
        ("gradients", c.gradients, "from the first backward to the optimizer step"),
        ("optimizer", c.optimizer, "its state" if c.optimizer else "its state is on the host"),
        ("optimizer step", c.optimizer_step, "beside the state while the step runs"),
        (
            "activations",
            c.activations,
            f"grows with the micro-batch: {format_bytes(c.activations_per_sample)} a sample more",
        ),
        ("batch", c.batch, "grows with the micro-batch"),
        (
            "other",
            c.other,
            "buffers, precision copies and, on a GPU, the CUDA context and the allocator's reserve",
        ),
    ]
    return [
        f"costs        each part at its own most, at micro-batch {c.micro_batch}",
        "             (the parts peak at different moments: their sum is more than the peak)",
        *(f"  {name:<15}{format_bytes(value):>12}  {why}".rstrip() for name, value, why in rows),
    ]


def export_command(args: argparse.Namespace) -> int:
    from autotune.integrations import export

    exported = export(load(args.path), args.to, path=args.path)
    for warning in exported.warnings:
        print(f"autotune: warning: {warning}", file=sys.stderr)
    if args.output is None:
        sys.stdout.write(exported.text)
    else:
        write_atomic(args.output, exported.text)
        print(f"written to {args.output}")
    return 0


def report(args: argparse.Namespace) -> int:
    from autotune.cli._report import write_report

    path = write_report(load(args.path), args.output)
    print(f"written to {path}")
    return 0


def _describe(result: TuneResult) -> str:
    c, b = result.config, result.breakdown
    per_rank = f" per rank, global {c.global_batch_size}" if c.world_size > 1 else ""
    lines = [
        f"config      {c.describe()}",
        f"            effective batch {c.effective_batch_size}{per_rank}; checkpoint: "
        + (", ".join(c.checkpoint) or "none")
        + (f"; selectively: {', '.join(c.selective_checkpoint)}" if c.selective_checkpoint else ""),
    ]
    lines += [f"{label:<11} {text}" for label, text in figures(result)]
    if result.edited:  # the breakdown is another config's
        lines.append("memory      not predicted for this config")
    else:
        lines += [
            "memory      " + ", ".join(f"{n} {format_bytes(getattr(b, n))}" for n in PARTS),
            f"            (other: {OTHER})",
        ]
    lines += [f"unverified  {note}" for note in result.unverified]
    lines += [f"{label:<11} {text}" for label, text in sureness(result)]
    for i, f in enumerate(result.fallbacks, 1):
        lines.append(f"fallback {i}  {f.describe()}")
    if result.by_length:
        lines.append("by sequence length (a row trains batches up to its length):")
        lines += [f"  {_row(r)}" for r in result.by_length]
    s = result.spent
    ran = [r for r in result.trials if r.error != PLANNED]
    planned = [r for r in result.trials if r.error == PLANNED]
    lines.append(
        f"{'planned' if planned and not ran else 'tuned'} in    {result.tuning_s:.1f} s: "
        f"profile {s.profile_s:.1f} s, search {s.search_s:.1f} s, verification "
        f"{s.verification_s:.1f} s"
    )
    if result.skipped:  # for max_tuning_s
        lines.append(f"skipped     for the time limit: {'; '.join(result.skipped)}")
    if result.compile_cache:  # read beside the file: the job compiles out of it
        lines.append(
            f"compiled    {format_bytes(len(result.compile_cache))} of the tuner's compiled "
            "code beside this file: prepare() and apply() start from it"
        )
    if ran or not planned:
        lines.append(f"verified    {len(ran)} configs run for real:")
        lines += [f"  {_trial(r)}" for r in ran]
    if planned:
        lines.append(f"planned     {len(planned)} configs, fastest predicted first, none run:")
        lines += [
            f"  {r.config.describe()}: {r.predicted.samples_per_s:.1f} samples/s, peak "
            f"{format_bytes(r.predicted.peak_bytes)}, predicted"
            for r in planned
        ]
    return "\n".join(lines)


def _row(r: LengthRow) -> str:
    """One row of a table per sequence length."""
    m = r.measured or r.predicted
    return (
        f"{r.length:>6}  {r.config.describe()}: {m.samples_per_s:.1f} samples/s "
        f"({m.samples_per_s * r.length:.0f} tokens/s), peak {format_bytes(m.peak_bytes)}"
        f"{'' if r.measured else ', predicted, NOT VERIFIED'}, {len(r.fallbacks)} fallbacks"
    )


def _trial(r: TrialRecord) -> str:
    """One verification: what it measured (re-timings included) or why it was rejected."""
    m = r.measured
    if m is None:
        return f"{r.config.describe()}: rejected, {r.error}"
    if r.peak_only:
        return (
            f"{r.config.describe()}: peak {format_bytes(m.peak_bytes)} (its peak alone, "
            f"over two micro-batches a step; speed not timed, predicted "
            f"{r.predicted.samples_per_s:.1f} samples/s)"
        )
    timed = f" (median of {len(r.timings)} timings)" if r.timings else ""
    return (
        f"{r.config.describe()}: {m.samples_per_s:.1f} samples/s{timed}, "
        f"predicted {r.predicted.samples_per_s:.1f}; peak {format_bytes(m.peak_bytes)}"
    )


def _peak(measurement: Any) -> str:
    return format_bytes(measurement.peak_bytes)


def _checkpoint(spec: str, model: Any, blocks: Sequence[str] | None) -> tuple[str, ...]:
    """``--checkpoint``: ``all`` (every block), ``none``, or block names separated by commas."""
    if spec.strip() == "none":
        return ()
    if spec.strip() == "all":
        from autotune._blocks import resolve_blocks

        return resolve_blocks(model, blocks)
    return _names(spec)


def join_torchrun(device: str | None) -> tuple[bool, bool]:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1 in the environment):
    NCCL on CUDA, gloo on the CPU. (Whether this process is the first rank, whether it
    joined one here.)"""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True, False
    import torch
    import torch.distributed as dist

    joined = not dist.is_initialized()
    if joined:
        cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank() == 0, joined


@contextlib.contextmanager
def leave_group(joined: bool) -> Iterator[None]:
    """Leave the process group joined for the command when it ends (its threads would
    abort the process at exit otherwise)."""
    try:
        yield
    finally:
        if joined:
            import torch.distributed as dist

            with contextlib.suppress(RuntimeError):  # a rank that failed: nothing to wait for
                dist.barrier()  # every rank done with its collectives before the group goes
            dist.destroy_process_group()
