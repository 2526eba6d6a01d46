"""The tuner's profile: memory first (cheap, decides what fits), then time only what can fit.

The model as the profiler measures it (:class:`ProfiledCopies`): whole on the device, or in
shallow pieces. A model trained sharded over several ranks may not fit the one device
its profile runs on; then, where its blocks are one container's uniform layers, it is
measured on shallow copies with 3 and then 4 of them (each on the device only while it
is measured) and the profile extended to its depth (:mod:`autotune.measure._depth`).
Tuning and :func:`autotune.estimate` both profile through this one choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autotune._profile_data import CHECKPOINT, KEEP, Profile
from autotune.config import Timeline, TrainConfig
from autotune.cost import Chooser, CostModel, choosers, largest_fitting, too_small
from autotune.device import backend_for
from autotune.errors import AutotuneError
from autotune.measure import (
    Profiler,
    deepen,
    deepen_time,
    fast_precisions,
    measure_transfer,
    memory_profile,
    shallow_copies,
    time_profile,
)
from autotune.train import any_batch_size, why_not_chunked
from autotune.tuning._problem import Problem

__all__ = ["ProfiledCopies", "budget_cap", "profile_model"]

log = logging.getLogger("autotune")


def budget_cap(problem: Problem) -> contextlib.AbstractContextManager[None]:
    """The allocator capped at the run's budget (:attr:`Problem.allocator_cap`), less the
    context as it is now: it grows as kernels load, so each stage caps anew."""
    cap = problem.with_context(problem.target.context_now()).allocator_cap
    return backend_for(problem.target.device).cap(cap)


def profile_model(
    replica: nn.Module,
    problem: Problem,
    *,
    whole: bool = True,
    on_target: Callable[[Profile], Profile] | None = None,
) -> Profile:
    """The profile of ``replica`` (the tuner's copy, or a plan's traced model), what fits
    decided over the data parallelism of the problem's ranks.

    ``on_target``: how the target holds a profile measured here, where it is not here (a
    plan's GPU: its context, allocator reserve and links); what fits is decided on the
    memory profile as the target holds it, and the profile is returned so.

    Not ``whole`` (see :func:`~autotune.measure._depth.whole_fits`), ``replica`` is on the
    host and profiled on shallow copies where it can be (else moved to the device and
    profiled whole). With offload searched, host<->device bandwidth, the offloaded variant
    and the host step of each optimizer are measured too.

    Raises:
        BudgetTooSmallError: nothing in the space fits the budget.
        ProfileError: the model cannot be trained on the sample batch, or does not fit.
    """
    t0 = time.perf_counter()
    device = problem.target.device
    pieces = ProfiledCopies(
        replica, problem.blocks, fits=whole, device=device, whole=lambda: replica.to(device)
    )
    profiler, draft, notes, timed = _memory_on(pieces, problem)
    context = problem.target.context_now()  # training steps have run: kernels loaded
    draft = dataclasses.replace(draft, context_bytes=context, notes=(*notes, *draft.notes))
    if on_target is None:  # the runner caps the allocator at the budget: replayed so
        draft = dataclasses.replace(draft, reserve_cap=problem.budget - context)
    held = on_target(draft) if on_target is not None else draft
    layouts = choosers(held, problem, problem.world)  # as the target holds the draft
    feasible = _feasible_sizes(problem, draft, layouts)
    log.info("profiling time at micro-batch sizes up to %s", max(feasible.values()))
    sizes = [s for s in problem.sizes if s not in draft.untrainable]
    # The context has grown as kernels loaded: the cap shrinks with it. A model compiled
    # whole is timed on one graph for every size (its memory: on each size's own graph).
    with budget_cap(problem), any_batch_size():
        profile = time_profile(
            profiler,
            draft,
            feasible,
            sizes,
            device_name=problem.target.name,
            timed=timed,
            fits_wherever=_fits_wherever(layouts),
        )
    if pieces.shallow:
        fp32 = Timeline("fp32")
        reference = fp32 if fp32 in profile.precisions else next(iter(profile.precisions))
        seconds, forward_s = profiler.block_times(reference, min(8, feasible[reference]))
        profile = deepen_time(profile, seconds, forward_s)
    for note in profile.notes:
        log.info("note: %s", note)
    if not problem.verifiable:  # planned: no fallback ladder, so no copy of the buffers
        profile = dataclasses.replace(profile, snapshot_bytes=0)
    if on_target is not None:
        profile = on_target(profile)
    return dataclasses.replace(profile, seconds=time.perf_counter() - t0)


def _memory_on(
    pieces: ProfiledCopies, problem: Problem
) -> tuple[Profiler, Profile, list[str], dict[Timeline, dict[int, float]]]:
    """The memory profile of ``pieces`` in the precisions fast enough to search: (the
    profiler the time profile runs on, the last piece's; the profile; notes; the passes
    timed while choosing the precisions, by timeline and size).

    On shallow copies the precisions are timed on the copy of 3 blocks, not on the copy
    the time profile runs on, and no compiled timeline is profiled.
    """
    each = pieces.each()
    model, blocks = next(each)
    profiler = Profiler.of(problem.workload(model, blocks))
    del model
    precisions, untrainable, slow, timed = fast_precisions(
        profiler, problem.precisions, problem.sizes, device_name=problem.target.name
    )
    if not pieces.shallow:
        worth = _worth_compiling(precisions, timed) if problem.world == 1 else ()
        compiled = worth if problem.compile else ()
        whole = worth if problem.compile_model else ()
        draft, notes = _memory(profiler, problem, precisions, compiled=compiled, whole=whole)
        draft = _with_chunked_loss(profiler, problem, draft, notes)
    else:
        timed = {}
        three, _ = _memory(profiler, problem, precisions)
        del profiler
        model, blocks = next(each)
        profiler = Profiler.of(problem.workload(model, blocks))
        del model
        four, notes = _memory(profiler, problem, precisions)
        draft = pieces.deepened(three, four)
    draft = dataclasses.replace(draft, untrainable=untrainable)
    return profiler, draft, [*slow, *notes], timed


def _memory(
    profiler: Profiler,
    problem: Problem,
    precisions: tuple[str, ...],
    *,
    compiled: tuple[str, ...] = (),
    whole: tuple[str, ...] = (),
) -> tuple[Profile, list[str]]:
    """The memory profile, with FSDP2's own bf16 timeline when several ranks are planned,
    the compiled blocks' timelines of the precisions ``compiled`` and those of the model
    compiled whole of the precisions ``whole``."""
    log.info("profiling memory on %s (%d blocks)", problem.target.name, len(profiler.blocks))
    with budget_cap(problem):
        draft, notes = memory_profile(
            profiler,
            tuple(Timeline(p) for p in precisions),
            problem.space.optimizers,
            device_name=problem.target.name,
            context_bytes=problem.target.context_bytes,
            transfer=measure_transfer(problem.target) if problem.offload else None,
            selective=problem.space.selective_checkpointing,
            compiled=compiled,
            whole=whole,
            sharded=problem.world > 1,  # FSDP2 computes bf16 in bf16 parameters
        )
    return draft, notes


_LOGITS_SHARE = 0.25
"""The chunked loss is searched (by default) where a sample's fp32 logits are at least
this share of what the sample holds through its step."""


def _with_chunked_loss(
    profiler: Profiler, problem: Problem, draft: Profile, notes: list[str]
) -> Profile:
    """``draft`` with the chunked loss's timeline of each of its timelines (eager, and
    compiled at each level profiled) where it is searched
    (:attr:`SearchSpace.chunked_loss`) and the model takes it."""
    wanted = problem.space.chunked_loss
    why = why_not_chunked(profiler.model, profiler.sample, profiler.loss_fn is not None)
    if wanted is False or why is not None:
        if wanted and why is not None:
            notes.append(f"the chunked loss: not searched, {why}")
        return draft
    eager = [t.precision for t in draft.precisions if not t.compiled]
    if wanted is None and _logits_share(profiler, draft, eager[0]) < _LOGITS_SHARE:
        return draft
    log.info("profiling the chunked loss")
    try:
        found, more = memory_profile(
            profiler,
            tuple(Timeline(p, chunked=True) for p in eager),
            problem.space.optimizers[:1],
            device_name=problem.target.name,
            context_bytes=problem.target.context_bytes,
            transfer=draft.transfer,
            selective=problem.space.selective_checkpointing,
            compiled=[p for p in eager if Timeline(p, "blocks") in draft.precisions],
            whole=[p for p in eager if Timeline(p, "model") in draft.precisions],
            chunked=True,
        )
    except AutotuneError as exc:  # it does not fit, or the model refuses it: not searched
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        notes.append(f"the chunked loss: not searched ({type(exc).__name__}: {first})")
        return draft
    notes.extend(more)
    return dataclasses.replace(draft, precisions={**draft.precisions, **found.precisions})


def _logits_share(profiler: Profiler, draft: Profile, precision: str) -> float:
    """A sample's fp32 logits over what it holds through its step, every block kept."""
    lm: Any = profiler.model  # a causal language model (why_not_chunked said so)
    tokens = math.prod(profiler.sample["labels"].shape[1:])
    logits = 4 * tokens * lm.get_output_embeddings().out_features
    optimizer = next(iter(draft.optimizers))
    config = TrainConfig(micro_batch_size=4, precision=precision, optimizer=optimizer)
    per_sample = CostModel(draft).costs(config).activations_per_sample
    return float(logits / max(per_sample, 1))


_COMPILE_WITHIN = 1.15
"""Precisions whose eager pass takes at most this many times the fastest one's get a
compiled timeline: compiling a slower precision costs seconds and rarely wins."""


def _worth_compiling(
    precisions: tuple[str, ...], timed: dict[Timeline, dict[int, float]]
) -> tuple[str, ...]:
    """The precisions to profile compiled: near the fastest eager one at the first size
    timed (every one where they were not all timed)."""
    seconds = {p: min(timed[t].values()) for p in precisions if timed.get(t := Timeline(p))}
    if len(seconds) < len(precisions):
        return precisions
    best = min(seconds.values())
    return tuple(p for p in precisions if seconds[p] <= _COMPILE_WITHIN * best)


def _fits_wherever(layouts: list[Chooser]) -> Callable[[Timeline, Timeline], bool]:
    """Whether timeline ``q`` fits every config timeline ``p`` fits under the choosers
    ``layouts``: at every size, optimizer and placement of every layout, with every block
    kept and with every block checkpointed (a mask between them fits where both ends do,
    or needs a little more checkpointing in ``q``)."""

    def fits(q: Timeline, p: Timeline) -> bool:
        for chooser in layouts:
            n = chooser.cost.n_blocks
            masks = [(KEEP,) * n, (CHECKPOINT,) * n] if chooser.checkpointing else [(KEEP,) * n]
            for b, o, h in itertools.product(
                chooser.sizes, chooser.optimizers, chooser.offload_optimizer
            ):
                for mask in masks:
                    peak = chooser.cost.peak_of(chooser.knobs(p, o, b, h).masked(mask))
                    if (
                        peak
                        <= chooser.limit
                        < chooser.cost.peak_of(chooser.knobs(q, o, b, h).masked(mask))
                    ):
                        return False
        return True

    return fits


def _feasible_sizes(
    problem: Problem, draft: Profile, layouts: list[Chooser]
) -> dict[Timeline, int]:
    """Per timeline of ``draft``, the largest micro-batch that fits some layout and
    optimizer of the choosers ``layouts`` (the draft as the target holds it).

    Raises:
        BudgetTooSmallError: none fits.
    """
    caps = {
        p: max(
            (
                b
                for q in layouts
                for o in q.optimizers
                if p in q.timelines and (b := largest_fitting(q, p, o))
            ),
            default=None,
        )
        for p in draft.precisions
    }
    feasible = {p: b for p, b in caps.items() if b is not None}
    if not feasible:
        helps = not backend_for(problem.target.device).host_is_device
        # The least any layout needs (with several ranks FSDP2's, not DDP's whole model).
        errors = [
            too_small(
                q, problem.space, problem.budget, headroom=problem.headroom, offload_helps=helps
            )
            for q in layouts
        ]
        raise min(errors, key=lambda e: e.minimum_bytes)
    return feasible


class ProfiledCopies:
    """``model`` whole, or its shallow copies of 3 and 4 blocks where it does not fit.

    Args:
        model: The model (read only; ``whole`` makes the copy that runs).
        blocks: Its blocks.
        fits: Whether it fits the device whole (see
            :func:`~autotune.measure._depth.whole_fits`).
        device: The device measured on.
        whole: Makes the model that is measured whole, on the device (also where it does
            not fit but its blocks cannot be copied shallowly).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: tuple[str, ...],
        *,
        fits: bool,
        device: torch.device,
        whole: Callable[[], nn.Module],
    ) -> None:
        self.model, self.blocks, self.device, self._whole = model, blocks, device, whole
        self.copies = None if fits else shallow_copies(model, blocks)
        if not fits and self.copies is None:
            log.info("the blocks are not uniform layers: profiling the whole model")
        elif self.copies is not None:
            log.info("profiling copies with 3 and 4 of the %d blocks", len(blocks))

    @property
    def shallow(self) -> bool:
        """Whether the pieces are shallow copies (two of them), not the whole model."""
        return self.copies is not None

    def each(self) -> Iterator[tuple[nn.Module, tuple[str, ...]]]:
        """Each piece on the device, with its blocks: the whole model, or the copy of 3
        blocks and then the copy of 4 (the caller lets go of one before the next)."""
        if self.copies is None:
            yield self._whole(), self.blocks
            return
        for depth in (3, 4):
            copy, blocks = self.copies.copy(depth)
            yield copy.to(self.device), blocks
            del copy
            gc.collect()
            backend_for(self.device).empty_cache()

    def deepened(self, three: Profile, four: Profile) -> Profile:
        """The model's profile from its copies' (see :func:`~autotune.measure.deepen`)."""
        return deepen(three, four, self.model, self.blocks)
