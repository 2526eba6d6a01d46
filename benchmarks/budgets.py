"""Budgets that force trade-offs, derived from a probe of the model on the device.

Two fp32 runs without checkpointing, at micro-batches ``G/8`` and ``G/4`` of a global
batch ``G`` (accumulating, as every run below ``G`` does), give the peak as a line in the
micro-batch: ``static + per_sample * b``. From it:

* ``fp32-no-G``: ``static + 0.75 * G * per_sample``: the whole global batch does not fit
  as one fp32 micro-batch, ``G/2`` does; lower precision or checkpointing may fit ``G``.
* ``tight``: ``static + 0.19 * G * per_sample``: fp32 without checkpointing fits only
  micro-batches up to ``G/8`` or so; checkpointing or precision buys larger ones.

The probe is measured, by the tuner's own definition of peak, so the budgets mean the
same on any CPU; CUDA cases use fixed budgets (16 and 24 GiB) instead.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass

import torch
from torch import nn

from autotune import TrainConfig
from autotune._format import GIB
from autotune.verify._verifier import Verifier

from .cases import Case

__all__ = ["HALF_AND_TIGHT", "Budget", "budgets_for"]

_FRACTIONS = (("fp32-no-G", 0.75), ("tight", 0.19))
HALF_AND_TIGHT = (("half", 0.5), ("tight", 0.19))
"""The held-out kinds' budgets (:mod:`benchmarks.kinds`): half the global batch fits as
one fp32 micro-batch, and the tight one."""
_PROBE_BUDGET = 1 << 50  # effectively none: the probe must not be cut short


@dataclass(frozen=True)
class Budget:
    """One device-memory budget of a case."""

    name: str
    budget_bytes: int
    why: str

    @property
    def gib(self) -> float:
        """The budget in GiB, as ``autotune(budget_gb=...)`` takes it."""
        return self.budget_bytes / GIB


def budgets_for(
    case: Case,
    model: nn.Module,
    device: torch.device,
    fractions: tuple[tuple[str, float], ...] = _FRACTIONS,
) -> list[Budget]:
    """The case's budgets, largest first (derived from a probe when not fixed: named
    and placed by ``fractions``, each ``(name, share of the global batch)``).

    The probe runs on a copy of ``model`` on ``device``, freed before returning.
    """
    if case.budgets_gib:
        return [
            Budget(f"{g:g}GiB", int(g * GIB), "fixed")
            for g in sorted(case.budgets_gib, reverse=True)
        ]
    g = case.global_batch_size or 32
    b1, b2 = max(g // 8, 1), max(g // 4, 2)
    verifier = Verifier(
        copy.deepcopy(model).to(device),
        case.sample(min(g, 8)),
        device=device,
        budget_bytes=_PROBE_BUDGET,
        loss_fn=case.loss_fn,
        steps=1,
    )
    peaks = []
    for b in (b1, b2):
        accum = max(g // b, 2) if case.global_batch_size else 1
        measured, error = verifier.trial(TrainConfig(micro_batch_size=b, grad_accum_steps=accum))
        if measured is None:
            raise RuntimeError(f"{case.name}: the budget probe at micro-batch {b} failed: {error}")
        peaks.append(measured.peak_bytes)
    del verifier
    gc.collect()
    per_sample = (peaks[1] - peaks[0]) / (b2 - b1)
    static = peaks[0] - per_sample * b1
    return [
        Budget(
            name,
            int(static + fraction * g * per_sample),
            f"static {static / 2**20:.1f} MiB + {fraction:g} x G={g} x "
            f"{per_sample / 2**20:.2f} MiB/sample (fp32, no checkpointing)",
        )
        for name, fraction in fractions
    ]
