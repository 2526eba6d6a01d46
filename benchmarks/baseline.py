"""The largest-batch-that-fits baseline: accelerate's ``find_executable_batch_size``, for real.

What a user of Hugging Face Trainer's ``auto_find_batch_size`` gets: fp32, no
checkpointing, the user's optimizer (AdamW); start at the global batch ``G`` and, on every
out-of-memory error, retry at ``int(0.9 * batch)`` (accelerate's default). Each attempt
trains a fresh copy of the model for two optimizer steps (the second holds the AdamW state
next to the activations: the first step alone would under-state the peak) with micro-batch
``batch`` and ``ceil(G / batch)`` accumulation steps, under the same budget as the tuner:

* CPU: inside :func:`autotune.measure._peak.measure_peak` with ``budget_bytes`` (the budget
  guard, which raises ``torch.OutOfMemoryError``);
* CUDA: the same call, which caps the caching allocator at the budget, so a real
  ``CUDA out of memory`` error is raised.

accelerate decides whether to retry with ``should_reduce_batch_size``, which matches message
strings (``" out of memory."`` among others). The CPU guard's message is worded like torch's
own (``"CPU out of memory. DefaultCPUAllocator: can't allocate memory: autotune budget
guard: ..."``), which it recognises as is; an error it would not recognise is re-raised
as ``torch.OutOfMemoryError("CPU out of memory. " + message)``. Whether the raw error was
recognised is recorded per attempt.

The batch found is then run keeping the global batch exact: micro-batch = the largest
divisor of ``G`` not above it, accumulation = ``G / micro-batch``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from accelerate.utils import find_executable_batch_size
from accelerate.utils.memory import should_reduce_batch_size
from torch import nn

from autotune import TrainConfig, prepare
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.train._batch import resize

from .cases import Case

__all__ = ["Attempt", "BaselineResult", "describe", "find_batch_baseline", "kept_global"]

_STEPS = 2
_LADDER_START = 64  # starting batch when the case fixes no global batch


@dataclass(frozen=True)
class Attempt:
    """One try of accelerate's loop."""

    batch_size: int
    fitted: bool
    peak_bytes: int | None = None
    error: str | None = None
    recognised_raw: bool | None = None
    """For an OOM: whether accelerate's ``should_reduce_batch_size`` caught our error as is."""


@dataclass
class BaselineResult:
    """What the batch-size finder found, and the config a user would then train with."""

    found_batch_size: int | None = None
    config: TrainConfig | None = None
    attempts: list[Attempt] = field(default_factory=list)
    wrapped: bool = False
    """Whether any OOM had to be re-raised in a form accelerate recognises."""
    seconds: float = 0.0
    error: str | None = None


def find_batch_baseline(
    case: Case,
    model: nn.Module,
    *,
    device: torch.device,
    budget_bytes: int,
    optimizer: str = "adamw",
    context_bytes: int = 0,
) -> BaselineResult:
    """Run accelerate's ``find_executable_batch_size`` on ``model`` under the budget."""
    g = case.global_batch_size
    out = BaselineResult()
    sample = case.sample(min(g or _LADDER_START, 8))
    started = time.perf_counter()

    def attempt(batch_size: int) -> int:
        _release(device)
        accum = math.ceil(g / batch_size) if g else 1
        config = TrainConfig(
            micro_batch_size=batch_size, grad_accum_steps=accum, optimizer=optimizer
        )
        foreign = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        work = copy.deepcopy(model).to(device)
        runner = prepare(work, config, lr=1e-6, loss_fn=case.loss_fn, device=device)
        batch = resize(sample, batch_size * accum)
        try:
            with measure_peak(
                device,
                existing=state_tensors(runner.model, runner.optimizer, runner.scaler),
                budget_bytes=budget_bytes,
                context_bytes=context_bytes,
                foreign_bytes=foreign,
            ) as reading:
                for _ in range(_STEPS):
                    runner.step(batch)
        except torch.OutOfMemoryError as exc:
            raw = should_reduce_batch_size(exc)
            message = str(exc).splitlines()[0] if str(exc) else "OOM"
            out.attempts.append(Attempt(batch_size, False, None, message, raw))
            if raw:
                raise
            out.wrapped = True
            raise torch.OutOfMemoryError(f"CPU out of memory. {message}") from None
        finally:
            del runner, work
        out.attempts.append(Attempt(batch_size, True, reading.peak_bytes))
        return batch_size

    train = cast(
        Callable[[], int],
        find_executable_batch_size(attempt, starting_batch_size=g or _LADDER_START),
    )
    try:
        found: int | None = train()
    except RuntimeError as exc:  # "No executable batch size found, reached zero."
        out.error = str(exc)
        found = None
    finally:
        _release(device)
    out.seconds = time.perf_counter() - started
    if found is not None:
        out.found_batch_size = found
        micro = kept_global(found, g)
        out.config = TrainConfig(
            micro_batch_size=micro,
            grad_accum_steps=g // micro if g else 1,
            optimizer=optimizer,
        )
    return out


def kept_global(found: int, global_batch: int | None) -> int:
    """The micro-batch a user keeping ``global_batch`` exact trains with after a finder
    found ``found``: the largest divisor of it not above ``found`` (``found`` without one)."""
    return max(b for b in range(1, found + 1) if not global_batch or global_batch % b == 0)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def describe(result: BaselineResult) -> dict[str, Any]:
    """The plain-data form for the JSON report."""
    return {
        "found_batch_size": result.found_batch_size,
        "config": None if result.config is None else result.config.describe(),
        "attempts": [dataclasses.asdict(a) for a in result.attempts],
        "wrapped_oom_for_accelerate": result.wrapped,
        "seconds": result.seconds,
        "error": result.error,
    }
