"""The time half of a profile: forward+backward seconds over micro-batch sizes, per precision.

Only what can fit is timed: the caller passes, per precision, the largest micro-batch
the memory profile says fits. A precision much slower than fp32 at the same micro-batch
cannot win and is dropped (with a note); the others are timed up a ladder of sizes until
the device saturates, and with every block checkpointed (and checkpointed selectively,
where that was profiled) at two of those sizes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from autotune._profile_data import CHECKPOINT, KEEP, SELECTIVE, PrecisionProfile, Profile, TimeCurve
from autotune.config import Timeline
from autotune.device import backend_for
from autotune.errors import BatchError, ProfileError
from autotune.measure._profiler import Profiler

__all__ = ["Fast", "fast_precisions", "time_profile"]

_SATURATED_S = 0.5
_LONGEST_PASS_S = 2.0
_SLOW_PRECISION = 1.6
"""A precision this many times slower than fp32 at the same micro-batch cannot win."""
_NEAR = 1.25
"""A first ratio within this factor of :data:`_SLOW_PRECISION` is timed twice more, in
turn with fp32, and the median ratio decides: one timing must not keep a precision in one
run and drop it in the next."""
_OUTRUN = 1.15
"""A precision this many times slower than another at the larger of two sizes timed in
both, and not this much faster at the smaller, where the other fits every config it
fits, cannot win by more than the noise: it is timed no further. Twice the lead that
re-timing a verified config races (the verifier's lost lead)."""
_COMPILED_PAYS = 0.97
"""Compiled blocks are timed in full where a pass takes at most this share of the eager
pass's time at the probe's micro-batch (they may still save memory; that alone is not
worth a search of its own)."""
_VARIANT_PASS_S = 0.5
"""The checkpointed variants are timed at the ladder's second size and at the largest
whose pass is predicted to take at most this (the ladder's last where every pass is that
short): their cost over the kept pass is a ratio, interpolated in size, which larger
passes only make slower to measure (three more of them per precision)."""
_TRIED_SIZES = 3
"""The smallest sizes tried before a failure is the model's, not a size's."""


class Fast(NamedTuple):
    """What :func:`fast_precisions` found."""

    precisions: tuple[str, ...]
    """Those not much slower than fp32 at the smallest micro-batch."""
    untrainable: tuple[int, ...]
    """The smallest sizes the model cannot train on."""
    notes: list[str]
    """A note per precision or size left out."""
    seconds: dict[Timeline, dict[int, float]]
    """The passes it timed, by (eager) timeline and micro-batch: the time profile reuses
    them."""


def fast_precisions(
    profiler: Profiler, precisions: Sequence[str], sizes: Sequence[int], *, device_name: str
) -> Fast:
    """The precisions not much slower than fp32 at the smallest micro-batch, the smallest
    sizes the model cannot train on, a note per one dropped, and the passes timed.

    Timed before anything else is measured, so that a precision the device only emulates
    (fp16 on most CPUs: several times slower) costs one small pass, not a memory profile
    and a time probe; one the device says it emulates (:meth:`Backend.emulates`) is not
    timed at all. The time profile checks again at a larger micro-batch, where a
    precision that pays off on a device shows it; at the smallest it is at worst as fast
    as fp32. The first pass also finds the smallest size of the space that trains: a
    model may not train on one sample (BatchNorm over a 1x1 feature map), which rules
    out that size, not the model.

    Raises:
        ProfileError: the model trains on none of the smallest sizes of the space.
    """
    reference = "fp32" if "fp32" in precisions else precisions[0]
    backend = backend_for(profiler.device)
    untrainable: list[int] = []
    notes: list[str] = []
    timed: dict[Timeline, dict[int, float]] = {}
    try:
        b, seconds = _first_trainable(profiler, Timeline(reference), sizes, untrainable, notes)
        timed[Timeline(reference)] = {b: seconds}
        kept = [reference]
        for p in precisions:
            if p == reference:
                continue
            if reference != "fp32":  # no fp32 to compare with: time decides later
                kept.append(p)
                continue
            if backend.emulates(p):  # no pass to time: it cannot be fast here
                notes.append(f"{p}: {device_name} has no {p} arithmetic of its own, not searched")
                continue
            timed[Timeline(p)] = {b: profiler.fwd_bwd_time(Timeline(p), b)}
            first = timed[Timeline(p)][b] / seconds
            ratio = _ratio(profiler, Timeline(p), Timeline(reference), b, first)
            if ratio > _SLOW_PRECISION:
                notes.append(_slow_note(p, ratio, device_name))
            else:
                kept.append(p)
    except torch.OutOfMemoryError:  # the device cannot hold even this: the profile decides
        return Fast(tuple(precisions), tuple(untrainable), notes, timed)
    return Fast(tuple(p for p in precisions if p in kept), tuple(untrainable), notes, timed)


def _first_trainable(
    profiler: Profiler,
    timeline: Timeline,
    sizes: Sequence[int],
    untrainable: list[int],
    notes: list[str],
) -> tuple[int, float]:
    """(size, seconds) of the smallest of ``sizes`` the model trains on, timed; the sizes
    below it go into ``untrainable``, each with a note.

    Raises:
        BatchError, ProfileError: the first few sizes (or all) fail: the model or the
            sample batch, not a size, is at fault.
    """
    first: ProfileError | BatchError | None = None
    for b in sizes[:_TRIED_SIZES]:
        try:
            return b, profiler.fwd_bwd_time(timeline, b)
        except (ProfileError, BatchError) as exc:  # BatchNorm at 1 sample: its forward fails
            first = first or exc
            untrainable.append(b)
            notes.append(_untrainable_note(b, exc))
    assert first is not None
    raise first


def _untrainable_note(b: int, exc: ProfileError | BatchError) -> str:
    """The note for a size the model failed on: the model's own error, in its words."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return f"micro-batch {b}: the model does not train on it ({cause}); not searched"


def _slow_note(timeline: Timeline | str, ratio: float, device_name: str) -> str:
    return f"{timeline}: {ratio:.1f}x slower than fp32 on {device_name}, not searched"


def time_profile(
    profiler: Profiler,
    draft: Profile,
    caps: Mapping[Timeline, int],
    sizes: Sequence[int],
    *,
    device_name: str,
    timed: Mapping[Timeline, Mapping[int, float]] | None = None,
    fits_wherever: Callable[[Timeline, Timeline], bool] | None = None,
) -> Profile:
    """``draft`` (a memory profile) with time curves and block weights measured.

    Args:
        profiler: The profiler of the tuner's copy of the model.
        draft: The memory profile; its notes are kept and added to.
        caps: Per timeline to time, the largest micro-batch that fits.
        sizes: The micro-batch sizes the search may pick (ascending).
        device_name: For notes.
        timed: Passes timed already on this profiler (:attr:`Fast.seconds`), reused.
        fits_wherever: Whether the first timeline fits every config of the second's
            (the memory model's say); ``None``: no timeline is outrun.

    Returns:
        The profile with only the timelines that were timed.
    """
    feasible = dict(caps)
    notes = list(draft.notes)
    probe = {p: _nearest(sizes, min(8, b)) for p, b in feasible.items()}
    fp32 = Timeline("fp32")
    reference = fp32 if fp32 in feasible else next(iter(feasible))
    times = {p: dict((timed or {}).get(p, {})) for p in feasible}
    probe[reference], seconds = _probe(profiler, reference, probe[reference], sizes, times)
    times[reference][probe[reference]] = seconds
    first = probe[reference]  # each precision timed where the reference was, if it fits
    at = {p: first if first <= feasible[p] else probe[p] for p in feasible}
    _drop_slow(profiler, feasible, times, at, reference, notes, device_name)
    if fits_wherever is not None:
        _drop_outrun(feasible, times, notes, fits_wherever, device_name)
        reference = reference if reference in feasible else next(iter(feasible))
    untrainable = list(draft.untrainable)
    precision_profiles = {
        p: _timed(profiler, draft, p, cap, sizes, times[p], notes, untrainable)
        for p, cap in feasible.items()
    }
    weights = profiler.block_weights(reference, probe[reference]) if profiler.blocks else ()
    return dataclasses.replace(
        draft,
        block_weights=weights,
        precisions=precision_profiles,
        notes=tuple(notes),
        untrainable=tuple(sorted(untrainable)),
    )


def _time_ladder(
    profiler: Profiler,
    timeline: Timeline,
    ladder: list[int],
    times: dict[int, float],
    notes: list[str],
    untrainable: list[int],
    variants: tuple[int, ...] = (),
    wrapped: dict[int, dict[int, float]] | None = None,
) -> list[int]:
    """Time forward+backward up the ladder into ``times``; returns the sizes timed.

    At the ladder's second size and at its last cheap one (:func:`_last_cheap`),
    ``variants`` (every block checkpointed, or selectively) are timed on the same runner,
    in turn with the kept pass, into ``wrapped[b]`` (by variant, the kept one too).

    An out-of-memory error past the first size ends the ladder there, with a note; a
    size the model fails on otherwise goes into ``untrainable``, with a note.

    Stops once the device is saturated (a doubling that no longer lowers the per-sample
    time by 3%, at a size whose pass takes over half a second) or a pass takes over 2 s.
    Larger sizes are then predicted at the last per-sample cost, and tuning does not
    spend minutes on them.
    """
    done: list[int] = []
    second = ladder[min(1, len(ladder) - 1)]
    for i, b in enumerate(ladder):
        paired = (
            bool(variants)
            and wrapped is not None
            and (b == second or (len(wrapped) < 2 and _last_cheap(ladder, i, times, done)))
        )
        if b not in times or paired:
            try:
                if paired and wrapped is not None:
                    wrapped[b] = profiler.fwd_bwd_times(timeline, b, (KEEP, *variants))
                    times[b] = wrapped[b][KEEP]
                else:
                    times[b] = profiler.fwd_bwd_time(timeline, b)
            except ProfileError as exc:
                if not done or done[-1] != _previous_size(ladder, b):
                    raise  # the first size, or two in a row: the model is at fault, not a size
                if b not in untrainable:
                    untrainable.append(b)
                    notes.append(_untrainable_note(b, exc))
                continue
            except torch.OutOfMemoryError:
                if not done:
                    raise
                # The memory model said b fits the budget, but the device (shared, or
                # fragmented) did not hold it: time up to here, verification decides the rest.
                notes.append(
                    f"{timeline}: out of device memory timing micro-batch {b}; "
                    f"timed up to {done[-1]}"
                )
                break
        done.append(b)
        if times[b] > _LONGEST_PASS_S:
            break
        if len(done) >= 3 and times[b] > _SATURATED_S:
            previous = done[-2]
            if times[b] / b > 0.97 * times[previous] / previous:
                break
    return done


def _last_cheap(
    ladder: Sequence[int], i: int, times: Mapping[int, float], done: Sequence[int]
) -> bool:
    """Whether ``ladder[i]`` is the largest size whose pass, predicted in proportion to
    the last one timed, takes at most :data:`_VARIANT_PASS_S`: the next size's would take
    more, or it is the ladder's last."""
    if not done:
        return i + 1 >= len(ladder)
    per_sample = times[done[-1]] / done[-1]
    if per_sample * ladder[i] > _VARIANT_PASS_S:
        return False
    return i + 1 >= len(ladder) or per_sample * ladder[i + 1] > _VARIANT_PASS_S


def _previous_size(ladder: Sequence[int], b: int) -> int | None:
    """The size before ``b`` on ``ladder``."""
    i = list(ladder).index(b)
    return ladder[i - 1] if i else None


def _probe(
    profiler: Profiler,
    timeline: Timeline,
    b: int,
    sizes: Sequence[int],
    times: Mapping[Timeline, Mapping[int, float]],
) -> tuple[int, float]:
    """(size, seconds) of the first timing: at ``b``, or halved until the device holds it
    (already in ``times``: not timed again)."""
    while True:
        if b in times[timeline]:
            return b, times[timeline][b]
        try:
            return b, profiler.fwd_bwd_time(timeline, b)
        except torch.OutOfMemoryError:
            smaller = [s for s in sizes if s <= b // 2]
            if not smaller:
                raise
            b = smaller[-1]


def _ladder(sizes: Sequence[int], cap: int) -> list[int]:
    """Micro-batch sizes to time: about powers of two up to ``cap``, and ``cap``."""
    out, target = [], 1
    allowed = [s for s in sizes if s <= cap]
    while target <= cap:
        pick = next((s for s in allowed if s >= target), None)
        if pick is not None and pick not in out:
            out.append(pick)
        target *= 2
    if cap not in out:
        out.append(cap)
    return sorted(out)


def _drop_outrun(
    feasible: dict[Timeline, int],
    times: dict[Timeline, dict[int, float]],
    notes: list[str],
    fits_wherever: Callable[[Timeline, Timeline], bool],
    device_name: str,
) -> None:
    """Drop from ``feasible`` and ``times`` (with a note) each eager precision that is
    :data:`_OUTRUN` times slower than another at the largest size timed in both, and not
    that much faster at a smaller one (two sizes or more), where the other fits wherever
    it fits: each of its configs is beaten by the same config in the other, or at the
    smallest sizes (where a pass is mostly overhead and the two are alike) tied with it.
    Its chunked loss's timeline goes with it. A precision with a compiled timeline is left
    alone: the compiled one was not compared."""
    eager = [p for p in feasible if not p.compiled and not p.chunked]
    compiled = {k.eager for k in feasible if k.compiled}
    for p in [p for p in eager if p not in compiled]:
        for q in eager:
            if q == p or q not in feasible:
                continue
            shared = sorted(set(times[p]) & set(times[q]))
            ratios = [times[p][b] / times[q][b] for b in shared]
            if (
                len(shared) < 2
                or ratios[-1] <= _OUTRUN
                or min(ratios) < 1 / _OUTRUN
                or not fits_wherever(q, p)
            ):
                continue
            at = ", ".join(f"{r:.2f}x at {b}" for b, r in zip(shared, ratios, strict=True))
            notes.append(
                f"{p}: the time of {q} times {at} (micro-batch) on {device_name}, and {q} "
                f"fits wherever {p} does: not timed further, not searched"
            )
            for key in [k for k in feasible if k.unchunked == p]:
                del feasible[key], times[key]
            break


def _nearest(sizes: Sequence[int], b: int) -> int:
    return min(sizes, key=lambda s: (abs(s - b), s))


def _drop_slow(
    profiler: Profiler,
    feasible: dict[Timeline, int],
    times: dict[Timeline, dict[int, float]],
    at: Mapping[Timeline, int],
    reference: Timeline,
    notes: list[str],
    device_name: str,
) -> None:
    """Time each precision against the reference at its size ``at``; drop from
    ``feasible`` and ``times`` (with a note) a precision much slower than fp32 and a
    compiled timeline slower than its eager twin. A chunked loss is slower than its
    plain twin by design (memory for time): it goes where its twin went for slowness
    (where only the chunked loss fits, it stays)."""
    slow = set()
    for p in list(feasible):
        if p == reference or p.chunked:
            continue
        b = at[p]
        times[p][b] = times[p].get(b) or profiler.fwd_bwd_time(p, b)
        ref = times[reference].get(b) or profiler.fwd_bwd_time(reference, b)
        eager = p.eager
        ratio = times[p][b] / ref
        if (
            Timeline("fp32") in feasible
            and (ratio := _ratio(profiler, p, reference, b, ratio)) > _SLOW_PRECISION
        ):
            notes.append(_slow_note(p, ratio, device_name))
            del feasible[p], times[p]
            slow.add(p)
        elif p.compiled and eager in feasible:
            twin = times[eager].get(b) or profiler.fwd_bwd_time(eager, b)
            times[eager][b] = twin
            if times[p][b] > _COMPILED_PAYS * twin:
                notes.append(
                    f"{p}: {times[p][b] / twin:.2f}x the eager time at micro-batch {b} on "
                    f"{device_name}, not searched"
                )
                del feasible[p], times[p]
                slow.add(p)
    for p in [p for p in feasible if p.chunked]:
        if p.unchunked in slow:
            del feasible[p], times[p]


def _ratio(profiler: Profiler, p: Timeline, reference: Timeline, b: int, first: float) -> float:
    """Timeline ``p``'s time over the reference's at micro-batch ``b``: ``first`` or, when
    near the threshold, the median of it and two more pairs timed in turn."""
    if abs(math.log(first / _SLOW_PRECISION)) >= math.log(_NEAR):
        return first
    more = [profiler.fwd_bwd_time(p, b) / profiler.fwd_bwd_time(reference, b) for _ in range(2)]
    return statistics.median([first, *more])


def _timed(
    profiler: Profiler,
    draft: Profile,
    p: Timeline,
    cap: int,
    sizes: Sequence[int],
    times: dict[int, float],
    notes: list[str],
    untrainable: list[int],
) -> PrecisionProfile:
    """Timeline ``p``'s memory profile with its time curve: forward+backward seconds at
    the sizes of its ladder up to ``cap`` (``times``: those timed already, added to)."""
    allowed = [s for s in sizes if s not in untrainable]
    if p.compiled:  # one sample is a graph of its own: not compiled for a curve
        allowed = [s for s in allowed if s > 1] or allowed
    # Every block checkpointed, and selectively: timed on the runner of the kept pass
    # (after its warm-up, in turn with it) at the second size and at the last one.
    variants: tuple[int, ...] = ()
    if profiler.blocks:
        variants = (CHECKPOINT, SELECTIVE) if draft.precisions[p].selective else (CHECKPOINT,)
    wrapped: dict[int, dict[int, float]] = {}
    planned = _ladder(allowed, cap)
    ladder = _time_ladder(profiler, p, planned, times, notes, untrainable, variants, wrapped)
    xs = tuple(sorted(times))
    ckpt_points = []
    if variants:  # where the ladder timed them, else (it stopped before) at its last size
        ckpt_points = sorted(wrapped) or [ladder[-1]]
    for b in ckpt_points:
        if b not in wrapped:  # the ladder stopped before its second size
            wrapped[b] = {KEEP: times[b], **profiler.fwd_bwd_times(p, b, variants)}
    ratios = {v: tuple(wrapped[b][v] / wrapped[b][KEEP] - 1 for b in ckpt_points) for v in variants}
    curve = TimeCurve(
        xs,
        tuple(times[x] for x in xs),
        tuple(ckpt_points),
        ratios.get(CHECKPOINT, ()),
        ratios.get(SELECTIVE, ()),
    )
    return dataclasses.replace(draft.precisions[p], time=curve)
