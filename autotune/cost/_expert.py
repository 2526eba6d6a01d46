"""The expert's recipe: the config a knowledgeable user writes by hand, the one to beat.

On a GPU it is what nanoGPT and torchtitan write: the fastest precision the device has
(bf16, else fp16), the whole model compiled with its loss, the user's optimizer fused
where torch has the kernel, no block checkpointed or every one, the largest micro-batch
that fits; the faster of the two, timed. On a CPU: the faster precision, nothing compiled
(compiling there costs more than it saves), no or every block checkpointed, the largest
micro-batch that fits. Every tuning run verifies these beside its own candidates, so that
the config it returns is never measured slower than the expert's beyond the noise. As an
expert finds it: each mask from the largest micro-batch predicted to fit down, the next
size tried where one runs out of memory, until one runs. Where none can be had, or the
recipe is not the one above (its compiled timeline not profiled), the run says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import Timeline, TrainConfig
from autotune.cost._chooser import Candidate, Chooser

__all__ = ["ExpertRecipe", "expert_candidates"]

_GPU_PRECISIONS = ("bf16", "fp16", "fp32")
"""A GPU expert's precision, first available first (nanoGPT: bf16 where supported)."""


@dataclass(frozen=True)
class ExpertRecipe:
    """The expert's configs over a chooser's space, and what to say of them."""

    ladders: tuple[tuple[Candidate, ...], ...] = ()
    """Per checkpoint mask (every block kept, every one checkpointed), its configs from
    the largest micro-batch predicted to fit down: tried in turn until one runs."""
    note: str = ""
    """Why there are none, or how the recipe differs from the expert's; empty: it is it."""


def expert_candidates(chooser: Chooser, device_type: str) -> ExpertRecipe:
    """The expert's recipe over ``chooser``'s space: every block kept, and every block
    checkpointed, each from the largest micro-batch that fits down (none where nothing
    fits, or where the chooser's layout is data parallel: the expert's loop is one
    process)."""
    if chooser.cost.layout.parallel != "none":
        return ExpertRecipe(note="data parallel: the expert's recipe is a loop of one process")
    timeline = _timeline(chooser, device_type)
    if timeline is None:
        return ExpertRecipe(note="no eager timeline was profiled to write it with")
    note = ""
    if device_type != "cpu" and timeline.level != "model":
        note = "eager: the whole model compiled was not profiled here (not searched)"
    blocks = chooser.cost.profile.blocks
    masks = [(), blocks] if blocks and chooser.checkpointing else [()]
    ladders = tuple(ladder for m in masks if (ladder := _fitting(chooser, timeline, m)))
    if not ladders:
        note = "no micro-batch of it is predicted to fit the budget"
    return ExpertRecipe(ladders, note)


def _timeline(chooser: Chooser, device_type: str) -> Timeline | None:
    """The expert's timeline among the chooser's: on a GPU the first of
    :data:`_GPU_PRECISIONS`, the whole model compiled where that was profiled; on a CPU the
    eager precision predicted fastest at the smallest micro-batch."""
    timelines = list(chooser.timelines)
    eager = [t for t in timelines if not t.compiled and not t.chunked]
    if not eager:
        return None
    if device_type != "cpu":
        first = next((t for p in _GPU_PRECISIONS for t in eager if t.precision == p), eager[0])
        whole = Timeline(first.precision, "model")
        return whole if whole in timelines else first
    profile, b = chooser.cost.profile, chooser.sizes[0]

    def seconds(timeline: Timeline) -> float:
        curve = profile.precisions[timeline].time
        return curve.fwd_bwd(b) if curve is not None else float("inf")

    return min(eager, key=seconds)


def _fitting(
    chooser: Chooser, timeline: Timeline, checkpoint: tuple[str, ...]
) -> tuple[Candidate, ...]:
    """The configs of ``timeline`` with ``checkpoint`` whose predicted peak fits,
    largest micro-batch first, with the user's optimizer on the device."""
    cost, optimizer = chooser.cost, chooser.optimizers[0]
    out = []
    for b in sorted(chooser.sizes, reverse=True):
        config = TrainConfig(
            micro_batch_size=b,
            grad_accum_steps=chooser.accum(b),
            **timeline.knobs(cost.profile.blocks),
            checkpoint=checkpoint,
            optimizer=optimizer,
        )
        prediction = cost.predict(config)
        if prediction.measurement.peak_bytes <= chooser.limit:
            out.append(Candidate(config, prediction))
    return tuple(out)
