"""``peak_memory()``: the peak of your own training, by the definition the budget uses.

A user checking that a training loop (autotune's runner, ``apply()``'s handle in a loop
of their own, or a trainer with autotune's callback) stays within the budget reads the
same figure verification read: on CUDA the caching allocator's reserved peak plus the
CUDA context, on the CPU the peak of live tensor bytes, counted exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from autotune.device import discover, resolve_device
from autotune.measure._peak import PeakReading, measure_peak
from autotune.measure._tracker import state_tensors
from autotune.train import Applied, measured_compiling

__all__ = ["PeakReading", "peak_memory"]


@contextlib.contextmanager
def peak_memory(*holding: Any, device: torch.device | str | None = None) -> Iterator[PeakReading]:
    """Measure the peak device memory of the block; read ``.peak_bytes`` after it.

    >>> with autotune.peak_memory(runner) as reading:
    ...     for batch in loader:
    ...         runner.step(batch)
    >>> reading.peak_bytes <= result.budget_bytes

    Args:
        holding: What already holds device memory when the block begins and counts
            towards its peak on the CPU: a handle from :func:`autotune.prepare` or
            :func:`autotune.apply`, models, optimizers. Tensors made inside the block
            (batches, activations, an optimizer's state) count on their own. On CUDA the
            allocator counts everything the process reserved.
        device: The device to measure; default: a handle's, else CUDA if available.

    On the CPU every op in the block is counted as it runs, which slows small models
    down (up to a few times): measure a few steps, not a whole run. A handle whose
    config compiles blocks runs them compiled, and their buffers count where their code
    is compiled inside the block (its first steps; code compiled before keeps a route
    past the count).
    """
    handles = [h for h in holding if isinstance(h, Applied)]
    if device is None:
        device = handles[0].device if handles else None
    target = resolve_device(device)
    objects = [o for o in holding if not isinstance(o, Applied)]
    for h in handles:
        objects += [h.model, h.optimizer, h.scaler]
    context = discover(target).context_bytes  # the CUDA context; 0 on the CPU
    compiled = any(h.config.compile_level != "none" for h in handles)
    with (
        measured_compiling(compiled),
        measure_peak(
            target,
            existing=state_tensors(*objects),
            context_bytes=context,
            gathering=[o for o in objects if isinstance(o, torch.nn.Module)],
            compiled=compiled,
        ) as reading,
    ):
        yield reading
