"""The expert's config on a GPU, the baseline the tuner must beat (issue 37; DESIGN).

What nanoGPT and torchtitan write by hand: bf16 autocast, the whole model under
``torch.compile``, fused AdamW (``adamw_fused``; a QLoRA recipe's ``paged_adamw8bit``),
the largest micro-batch that fits the budget, no checkpointing or every layer's (Hugging
Face's ``gradient_checkpointing_enable``), the faster of those timed together. The loop is
the expert's own (micro-batches, the loss over the accumulation, one optimizer step), not
autotune's runner.

The largest micro-batch is found as an expert finds it, by trying: the divisors of the
global batch from the largest down, each a step in eager mode (an out-of-memory error
costs no compilation); then compiled at the one found and, where a larger divisor is left,
at that too (a compiled step can hold less than the eager one). Every try runs under the
budget (the caching allocator capped at it, less the context); the peak is autotune's
definition (reserved + context), the time the median of whole optimizer steps after two
warm-up steps, timed by the harness every arm is timed by (benchmarks/harness.py).
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from autotune.device import backend_for
from autotune.train._optimizers import build_optimizer
from benchmarks.harness import STEPS, WARMUP, time_steps

__all__ = ["ExpertRun", "expert_config"]

_LR = 1e-5


@dataclass
class ExpertRun:
    """One setting of the expert's knobs, run for real (or why it could not be)."""

    micro_batch_size: int
    grad_accum_steps: int
    checkpointing: bool
    compiled: bool
    optimizer: str
    peak_bytes: int | None = None
    step_s: float | None = None
    samples_per_s: float | None = None
    error: str | None = None

    def describe(self) -> str:
        return (
            f"b{self.micro_batch_size}x{self.grad_accum_steps} bf16 "
            f"{'ckpt-all' if self.checkpointing else 'no-ckpt'} "
            f"{'compiled' if self.compiled else 'eager'} {self.optimizer}"
        )


@dataclass
class ExpertResult:
    """The expert's pick, and every run that decided it."""

    best: ExpertRun | None
    runs: list[ExpertRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "best": asdict(self.best) if self.best else None,
            "config": self.best.describe() if self.best else None,
            "runs": [{**asdict(r), "config": r.describe()} for r in self.runs],
            "notes": self.notes,
        }


def expert_config(
    model: nn.Module,
    sample: Callable[[int], dict[str, torch.Tensor]],
    global_batch_size: int,
    budget_bytes: int,
    device: torch.device,
    *,
    optimizer: str = "adamw_fused",
    checkpointing: tuple[bool, ...] = (False, True),
    backend: str = "inductor",
    in_place: bool = False,
) -> ExpertResult:
    """The expert's fastest config of ``model`` within ``budget_bytes`` on ``device``.

    ``in_place``: train ``model`` itself (a QLoRA base already on the device, too large
    to copy beside the tuner's) rather than a copy moved to the device.
    """
    result = ExpertResult(None)
    batch = {k: v.to(device) for k, v in sample(global_batch_size).items()}
    sizes = [b for b in range(global_batch_size, 0, -1) if global_batch_size % b == 0]
    for ckpt in checkpointing:
        fits = _largest_eager(model, batch, sizes, budget_bytes, device, optimizer, ckpt, in_place)
        if fits is None:
            result.notes.append(f"{'ckpt-all' if ckpt else 'no-ckpt'}: nothing fits eagerly")
            continue
        larger = [b for b in sizes if b > fits][-1:]  # the next divisor up, if any
        for b in [fits, *larger]:
            run = _run(model, batch, b, budget_bytes, device, optimizer, ckpt, backend, in_place)
            if run.error and not run.error.startswith("OutOfMemoryError"):
                result.notes.append(f"compiling failed, the expert runs eagerly: {run.error}")
                run = _run(model, batch, b, budget_bytes, device, optimizer, ckpt, None, in_place)
            result.runs.append(run)
    timed = [r for r in result.runs if r.samples_per_s is not None]
    result.best = max(timed, key=lambda r: r.samples_per_s or 0.0, default=None)
    return result


def _largest_eager(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    sizes: list[int],
    budget_bytes: int,
    device: torch.device,
    optimizer: str,
    ckpt: bool,
    in_place: bool,
) -> int | None:
    """The largest micro-batch of ``sizes`` whose eager step fits the budget."""
    for b in sizes:
        run = _run(model, batch, b, budget_bytes, device, optimizer, ckpt, None, in_place, steps=0)
        if run.error is None:
            return b
    return None


def _run(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    b: int,
    budget_bytes: int,
    device: torch.device,
    optimizer: str,
    ckpt: bool,
    backend: str | None,
    in_place: bool,
    *,
    steps: int = STEPS,
) -> ExpertRun:
    """The expert's loop at micro-batch ``b`` under the budget: two warm-up steps, then
    ``steps`` timed ones (none: a step that fits is all that is asked)."""
    g = len(next(iter(batch.values())))
    run = ExpertRun(b, g // b, ckpt, backend is not None, optimizer)
    ops = backend_for(device)
    _release(device)
    foreign = ops.foreign_bytes()
    context = ops.context_bytes()
    work = model if in_place else copy.deepcopy(model).to(device)
    _checkpointing(work, ckpt)
    _named_loss(work)
    forward = torch.compile(work, backend=backend) if backend is not None else work
    opt = build_optimizer(optimizer, [p for p in work.parameters() if p.requires_grad], _LR)
    try:
        with ops.cap(budget_bytes - context + foreign):
            for _ in range(WARMUP if steps else 1):
                _step(forward, opt, batch, b, device)
            ops.synchronize()
            ops.reset_peak()
            if steps:  # the harness every arm is timed by (warmed up above)
                step = functools.partial(_step, forward, opt, batch, b, device)
                timing = time_steps(step, device, steps, warmup=0)
                run.step_s = timing.step_s
                run.samples_per_s = g / run.step_s
                if ops.caching:  # the CPU's peak is not read here: a smoke run's
                    run.peak_bytes = ops.max_reserved() - foreign + ops.context_bytes()
    except torch.OutOfMemoryError as exc:
        run.error = f"OutOfMemoryError: {str(exc).splitlines()[0][:160]}"
    except Exception as exc:  # the compiler's own failure: said, and the expert runs eagerly
        run.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    finally:
        opt.zero_grad(set_to_none=True)
        del opt, forward
        if not in_place:
            del work
        _release(device)
    return run


def _step(
    forward: Callable[..., Any],
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    b: int,
    device: torch.device,
) -> None:
    """One optimizer step over the whole batch, ``b`` samples a forward."""
    g = len(next(iter(batch.values())))
    for i in range(0, g, b):
        chunk = {k: v[i : i + b] for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(**chunk).loss / (g // b)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _named_loss(model: nn.Module) -> None:
    """Name the loss of each causal LM inside ``model``, as an expert does once the graph
    break shows: without it Hugging Face's loss warns through a logger dynamo cannot
    trace, which splits the compiled graph between the logits and the loss."""
    for m in model.modules():
        if hasattr(m, "loss_type") and getattr(m, "loss_type", None) is None:
            m.loss_type = "ForCausalLM"


def _checkpointing(model: nn.Module, on: bool) -> None:
    """Hugging Face's checkpointing of every layer, on or off (non-reentrant, as torch
    recommends)."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    model.config.use_cache = False


def _release(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # each try compiles its own graph, as a fresh job would
    backend_for(device).empty_cache()
