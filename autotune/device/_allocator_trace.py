"""Traces of the CUDA caching allocator: what it did in a stretch of a run, kept small.

A trace holds the allocator's segments (and their blocks) when the stretch began, every
action it took in between (``alloc``, ``free_completed``, ``segment_alloc``,
``segment_free``, ``segment_map``, ``segment_unmap``, ...: torch's memory-history
records, without their stack frames), its segments when the stretch ended and its
``PYTORCH_CUDA_ALLOC_CONF``. :func:`recording` writes one on a GPU (gzipped JSON);
:func:`read_trace` reads one back, for the allocator's model to replay on any machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autotune._profile_data import Line, Requests, Segment, StepRequests
from autotune.device._caching_allocator import (
    UNLIMITED,
    AllocatorSettings,
    CachingAllocator,
    OutOfMemory,
)

__all__ = [
    "CANNOT_RUN",
    "Divergence",
    "Recorded",
    "RequestLog",
    "Trace",
    "allocator_conf",
    "read_trace",
    "recorded",
    "recording",
    "relaid",
    "replay",
    "request_log",
    "reserved_beyond",
    "restore",
    "segment_of",
]

_SEGMENT_KEYS = ("address", "total_size", "stream", "segment_type", "is_expandable")
_BLOCK_KEYS = ("address", "size", "requested_size", "state")
_ACTION_KEYS = ("action", "addr", "size", "stream")


class Divergence(Exception):
    """The model did not do what the recorded allocator did."""


@dataclass(frozen=True)
class Trace:
    """A stretch of a run as the caching allocator saw it."""

    settings: str
    """The allocator's settings in force, as a ``PYTORCH_CUDA_ALLOC_CONF`` string (see
    :func:`allocator_conf`)."""
    start: list[dict[str, Any]]
    """Segments when the stretch began, each with its blocks."""
    actions: list[dict[str, Any]]
    """The allocator's actions, in order."""
    end: list[dict[str, Any]]
    """Segments when it ended."""
    max_reserved: int
    """``torch.cuda.max_memory_reserved`` over the stretch."""
    about: dict[str, Any]
    """What ran (the config, the job)."""


@dataclass
class Recorded:
    """What :func:`recorded` saw, once its block is over (``None`` off CUDA)."""

    trace: Trace | None = None


@contextlib.contextmanager
def recorded(device: torch.device, **about: Any) -> Iterator[Recorded]:
    """Record the caching allocator's actions in the block as a :class:`Trace` (its peak
    counted from the block's start); nothing off CUDA, or where this torch cannot
    record them (the block runs all the same)."""
    out = Recorded()
    cuda = device.type == "cuda"
    index = (
        (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    )
    start = _started(device, index) if cuda else None
    if start is None:
        yield out
        return
    memory = torch.cuda.memory
    try:
        yield out
        torch.cuda.synchronize(device)
        snapshot = memory._snapshot(device)
    finally:
        memory._record_memory_history(None, device=device)
    out.trace = Trace(
        settings=allocator_conf(snapshot),
        start=start,
        actions=[_kept(a, _ACTION_KEYS) for a in snapshot["device_traces"][index]],
        end=_segments(snapshot, index),
        max_reserved=int(torch.cuda.max_memory_reserved(device)),
        about=about,
    )


_NO_SPLIT_LIMIT = 1 << 62
"""A ``max_split_size`` this large or larger is the allocator's default: none."""


def allocator_conf(snapshot: dict[str, Any] | None = None) -> str:
    """The caching allocator's settings in force, as a ``PYTORCH_CUDA_ALLOC_CONF`` string
    of what decides what it reserves: from ``snapshot`` (``torch.cuda.memory._snapshot()``,
    which carries them however they were set: either environment variable, or
    ``torch.cuda.memory._set_allocator_settings`` at run time), else from the environment
    as the allocator reads it (``PYTORCH_ALLOC_CONF`` first, then
    ``PYTORCH_CUDA_ALLOC_CONF``)."""
    given = (snapshot or {}).get("allocator_settings")
    if not given:
        env = os.environ
        return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    parts = []
    if 0 < int(given.get("max_split_size", _NO_SPLIT_LIMIT)) < _NO_SPLIT_LIMIT:
        parts.append(f"max_split_size_mb:{int(given['max_split_size']) >> 20}")
    divisions = given.get("roundup_power2_divisions") or {}
    if any(int(v) for v in divisions.values()):
        table = ",".join(
            f"{int(k)}:{int(v)}" for k, v in sorted(divisions.items(), key=lambda x: int(x[0]))
        )
        parts.append(f"roundup_power2_divisions:[{table}]")
    if given.get("expandable_segments"):
        parts.append("expandable_segments:True")
    if float(given.get("garbage_collection_threshold", 0.0)) > 0:
        parts.append(f"garbage_collection_threshold:{float(given['garbage_collection_threshold'])}")
    conf = str(given.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if "backend:cudaMallocAsync" in conf.replace(" ", ""):
        parts.append("backend:cudaMallocAsync")
    return ",".join(parts)


def _started(device: torch.device, index: int) -> list[dict[str, Any]] | None:
    """The allocator's segments on device ``index`` now, its history recorded from here
    on; ``None`` where this torch cannot record it."""
    memory = torch.cuda.memory
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        start = _segments(memory._snapshot(device), index)
        memory._record_memory_history("all", context=None, device=device, clear_history=True)
    except (AttributeError, RuntimeError, TypeError):  # an older torch, another backend
        return None
    return start


@contextlib.contextmanager
def recording(path: Path, device: torch.device, **about: Any) -> Iterator[None]:
    """:func:`recorded`, written to ``path`` (gzipped JSON) once the block is over."""
    with recorded(device, **about) as out:
        yield
    if out.trace is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump(vars(out.trace), f, separators=(",", ":"))


def read_trace(path: Path) -> Trace:
    """The :class:`Trace` :func:`recording` wrote to ``path``."""
    with gzip.open(path, "rt") as f:
        return Trace(**json.load(f))


def _segments(snapshot: dict[str, Any], device: int) -> list[dict[str, Any]]:
    return [
        {**_kept(s, _SEGMENT_KEYS), "blocks": [_kept(b, _BLOCK_KEYS) for b in s["blocks"]]}
        for s in snapshot["segments"]
        if s.get("device", device) == device
    ]


def _kept(record: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: record[k] for k in keys if k in record}


_SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")


def replay(trace: Trace) -> CachingAllocator:
    """The allocator's model, started from the trace's first segments and fed its requests
    and frees: each request must land where the recorded allocator put it, and each
    segment the model takes or gives back must be the recorded one (new segments take
    the recorded addresses, the driver's choice). The model is returned as it ends, to
    compare with :attr:`Trace.end` (its :meth:`~CachingAllocator.snapshot` with each
    segment's :func:`segment_of`) and :attr:`Trace.max_reserved`.

    Raises:
        Divergence: at the first action where the model and the trace part.
    """
    segments = [a for a in trace.actions if a["action"] in _SEGMENT_ACTIONS]

    def address(size: int) -> int:  # the next segment action the model is about to take
        taken = len(model.events)
        if taken >= len(segments):
            raise Divergence(f"the model takes a segment of {size} bytes the trace never took")
        return int(segments[taken]["addr"])

    model = CachingAllocator(AllocatorSettings.parse(trace.settings), segment_address=address)
    restore(model, [segment_of(s) for s in trace.start])
    checked = 0
    for i, action in enumerate(trace.actions):
        kind = action["action"]
        if kind == "alloc":
            block = model.malloc(action["size"], action["stream"])
            if block.address != action["addr"]:
                raise Divergence(
                    f"action {i}: {action['size']} bytes placed at {block.address}, "
                    f"recorded at {action['addr']}"
                )
        elif kind == "free_completed":
            model.free(action["addr"])
        elif kind == "oom":
            raise Divergence(f"action {i}: the recorded run ran out of memory")
        checked = _check_segments(model, segments, checked, i)
    if checked < len(segments):
        raise Divergence(f"the trace did {segments[checked]['action']} the model never did")
    return model


def _check_segments(
    model: CachingAllocator, segments: list[dict[str, Any]], checked: int, i: int
) -> int:
    """Check the model's segment actions from ``checked`` on against the recorded ones;
    how many are checked now."""
    for taken, (action, address, size) in enumerate(model.events[checked:], checked):
        if taken >= len(segments):
            raise Divergence(f"action {i}: the model did {action} the trace never did")
        r = segments[taken]
        if (r["action"], r["addr"], r["size"]) != (action, address, size):
            raise Divergence(
                f"action {i}: the model did {action} of {size} bytes at {address}, the "
                f"allocator {r['action']} of {r['size']} bytes at {r['addr']}"
            )
    return len(model.events)


@dataclass
class RequestLog:
    """A stretch's requests to the caching allocator: the segments it began with, each
    allocation's (bytes, stream), and the order of allocations and frees (``i``: made,
    ``-1 - i``: freed)."""

    start: list[Segment] = field(default_factory=list)
    allocations: list[tuple[int, int]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    cuts: list[int] = field(default_factory=list)
    """Where stretches of the step begin, as positions in ``order``."""
    settings: str = ""
    """The allocator's settings in force (:func:`allocator_conf`)."""


def request_log(trace: Trace, cuts: Sequence[int] = ()) -> RequestLog:
    """The requests of a recorded trace (its allocations and completed frees); ``cuts``:
    where stretches begin, counted in the trace's allocations and completed frees."""
    log = RequestLog(start=[segment_of(s) for s in trace.start], settings=trace.settings)
    live: dict[int, int] = {}  # address -> allocation
    counted = 0  # allocations and completed frees so far, the cuts' unit
    pending = list(cuts)
    for action in trace.actions:
        while pending and counted >= pending[0]:
            log.cuts.append(len(log.order))
            pending.pop(0)
        counted += action["action"] in ("alloc", "free_completed")
        if action["action"] == "alloc":
            live[action["addr"]] = len(log.allocations)
            log.order.append(len(log.allocations))
            log.allocations.append((action["size"], action["stream"]))
        elif action["action"] == "free_completed" and action["addr"] in live:
            log.order.append(-1 - live.pop(action["addr"]))
    log.cuts.extend(len(log.order) for _ in pending)
    return log


def segment_of(segment: dict[str, Any]) -> Segment:
    """A snapshot's segment as a profile keeps it."""
    blocks = tuple((b["size"], b["state"] != "inactive") for b in segment["blocks"])
    small = segment["segment_type"] == "small"
    return (
        segment["address"],
        segment["stream"],
        small,
        bool(segment.get("is_expandable")),
        blocks,
    )


CANNOT_RUN = 1 << 50
"""What :func:`reserved_beyond` says of a step the capped allocator cannot serve: more
than any budget, so that the config is refused as the device would refuse it."""


def reserved_beyond(
    requests: Requests,
    b: int,
    accum: int = 2,
    cap: int = 0,
    step: tuple[StepRequests, int] | None = None,
) -> int:
    """What the caching allocator reserves for the run beyond its live bytes, at the most
    of each, in a step of ``requests`` at micro-batch ``b`` with ``accum`` micro-batches:
    the allocator's model fed the step's requests at that size from the segments the
    step began with (the recorded second micro-batch repeated for the third on, at most
    twice: the cache is steady by then; none with one micro-batch).

    ``cap``: the most the allocator may reserve for the run's tensors, as a runner caps
    it (the budget less the context; 0: uncapped). Under it the model does as the
    allocator does before a request would pass it: gives back cached segments
    (``garbage_collection_threshold`` first, where set) and tries again, so that it
    reserves less than uncapped; a step it cannot serve even then is
    :data:`CANNOT_RUN`.

    ``step``: another optimizer's step and the live bytes a training step with it begins
    with (its state for the profiled one's): the step starts from its segments, and its
    ``optimizer.step()`` requests take the place of the profiled optimizer's."""
    if step is not None:
        requests = _with_step(requests, *step)
    limit = cap + requests.foreign if cap else UNLIMITED
    model = CachingAllocator(AllocatorSettings.parse(requests.settings), limit=limit)
    restore(model, requests.start)
    order = _step_order(requests, accum)
    peak = 0
    for _ in range(STEADY_STEPS):  # each step from the cache the one before left
        before = model.max_reserved
        try:
            peak = max(peak, _replayed_step(model, requests, order, b))
        except OutOfMemory:
            return CANNOT_RUN
        if model.max_reserved == before:
            break
    return model.max_reserved - requests.foreign - (requests.held + peak)


def _with_step(requests: Requests, step: StepRequests, held: int) -> Requests:
    """``requests`` with another optimizer's step (see :func:`reserved_beyond`): its
    micro-batches, then the other optimizer's step, then what the micro-batches made that
    the profiled step freed (the gradients, at its end)."""
    if len(requests.cuts) != 3:
        return requests
    n, cut = len(requests.sizes), requests.cuts[2]
    micro = {i for i in requests.order[:cut] if i >= 0}
    later = [i for i in requests.order[cut:] if i < 0 and -1 - i in micro]
    steps = [i + n if i >= 0 else i - n for i in step.order]
    return dataclasses.replace(
        requests,
        start=step.start,
        sizes=(*requests.sizes, *(Line(float(size), 0.0) for size in step.sizes)),
        streams=(*requests.streams, *step.streams),
        order=(*requests.order[:cut], *steps, *later),
        held=held,
    )


STEADY_STEPS = 4
"""Steps replayed at most, as verification measures them: a run's later steps start
from the segments the step before cached (a step's requests free all they make), and
the replay stops once a step reserves nothing new."""


def _replayed_step(model: CachingAllocator, requests: Requests, order: list[int], b: int) -> int:
    """Feed ``model`` one step's requests at micro-batch ``b``; the step's live peak."""
    live = peak = 0
    made: dict[int, tuple[int, int]] = {}  # allocation -> (address, bytes), the latest
    for i in order:
        if i >= 0:
            n = max(math.ceil(requests.sizes[i](b)), 1)
            made[i] = (model.malloc(n, requests.streams[i]).address, n)
            live += n
            peak = max(peak, live)
        elif -1 - i in made:
            address, n = made.pop(-1 - i)
            model.free(address)
            live -= n
    for address, _ in made.values():  # what the recorded step kept: its next step frees
        model.free(address)
    return peak


def relaid(start: Iterable[Segment], settings: str) -> list[Segment]:
    """The segments an allocator with ``settings`` would hold for the blocks in use in
    ``start``, had it served them one by one in address order from nothing (what the
    run's lasting tensors take under another setting)."""
    model = CachingAllocator(AllocatorSettings.parse(settings))
    for _, stream, _, _, blocks in sorted(start):
        for size, used in blocks:
            if used:
                model.malloc(size, stream)
    return model.snapshot()


def _step_order(requests: Requests, accum: int) -> list[int]:
    """The requests of a step of ``accum`` micro-batches, from a recorded step of two
    (cut where the first, the second and the optimizer step begin)."""
    order = requests.order
    if len(requests.cuts) != 3:
        return list(order)
    _, second, step = requests.cuts
    repeats = min(accum - 1, 2)
    return [*order[:second], *(order[second:step] * repeats), *order[step:]]


def restore(model: CachingAllocator, segments: Iterable[Segment]) -> None:
    """Put ``segments`` in the model as the allocator held them."""
    expandable: dict[tuple[bool, int], list[tuple[int, list[tuple[int, bool]]]]] = {}
    for address, stream, small, grows, blocks in segments:
        if grows:
            expandable.setdefault((small, stream), []).append((address, list(blocks)))
        else:
            model.restore(address, list(blocks), small=small, stream=stream)
    for (small, stream), stretches in expandable.items():
        model.restore_expandable(stretches, small=small, stream=stream)
