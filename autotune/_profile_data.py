"""What a profile holds: the measurements of a model on the target, and their JSON form.

The profiler (:mod:`autotune.measure._profiler`) fills these records; the cost model
(:mod:`autotune.cost._cost_model`) reads them. This module imports no training code, so the
cost model can read a profile without loading the runtime.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from autotune.config import Timeline

__all__ = [
    "CHECKPOINT",
    "KEEP",
    "OFFLOAD",
    "SELECTIVE",
    "Collectives",
    "Crossing",
    "Line",
    "OptimizerProfile",
    "Phase",
    "PhaseKey",
    "PrecisionProfile",
    "Profile",
    "Requests",
    "StepRequests",
    "TimeCurve",
    "Transfer",
    "profile_from_json",
    "profile_to_json",
]


@dataclass(frozen=True)
class Transfer:
    """Host<->device copy speeds measured on the target, and the host memory offload may use.

    Attributes:
        d2h_bytes_per_s: Device to pinned host memory.
        h2d_bytes_per_s: Pinned host memory to device.
        host_limit_bytes: Host bytes offload may plan to hold (a share of what is free).
        rounds_host: Each host buffer takes a power of two (torch's pinned allocator).
    """

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_limit_bytes: int
    rounds_host: bool = False


KEEP, CHECKPOINT, OFFLOAD, SELECTIVE = 0, 1, 2, 3
"""A block's choices, and the index of each one's variant in a phase's lines: keep its
activations, recompute them, send them to the host, or recompute only its cheap ops."""


class PhaseKey(NamedTuple):
    """Where a phase sits in a tracked step (see :mod:`autotune.measure._timeline`)."""

    micro: int
    """Micro-batch 1 (gradients being created), 2 (accumulating), or 3 (optimizer step)."""
    label: str
    """``start``, ``pre``, ``fwd``, ``after``, ``head_bwd``, ``bwd``, ``end`` or ``opt``."""
    block: int | None = None
    """The block a ``fwd``, ``after`` or ``bwd`` phase belongs to."""


@dataclass(frozen=True)
class Line:
    """``value(b) = const + slope * b``: a quantity linear in the micro-batch size."""

    const: float
    slope: float

    def __call__(self, b: float) -> float:
        return self.const + self.slope * b

    def __add__(self, other: Line) -> Line:
        return Line(self.const + other.const, self.slope + other.slope)

    def __sub__(self, other: Line) -> Line:
        return Line(self.const - other.const, self.slope - other.slope)

    @staticmethod
    def through(b1: int, v1: float, b2: int, v2: float) -> Line:
        slope = (v2 - v1) / (b2 - b1)
        return Line(v1 - slope * b1, slope)

    @staticmethod
    def rising(points: Sequence[tuple[int, float]]) -> Line:
        """The least-squares line through ``(b, value)`` points, never falling with ``b``:
        where the fit falls (noise, or rounding that weighs more at small sizes), the
        largest value as a constant, so that extrapolating to larger sizes stays safe."""
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_v = sum(v for _, v in points) / n
        spread = sum((b - mean_b) ** 2 for b, _ in points)
        slope = sum((b - mean_b) * (v - mean_v) for b, v in points) / spread if spread else 0.0
        if slope <= 0:
            return Line(max(v for _, v in points), 0.0)
        return Line(mean_v - slope * mean_b, slope)


@dataclass(frozen=True)
class Collectives:
    """Seconds of each collective on the process group against its bytes, measured."""

    world_size: int
    all_gather: Line
    """Against the bytes gathered (the output)."""
    reduce_scatter: Line
    """Against the bytes reduced (the input)."""
    all_reduce: Line


@dataclass(frozen=True)
class Phase:
    """One phase of a micro-batch: its kept, checkpointed, offloaded and selectively
    checkpointed variants, indexed by :data:`KEEP`, :data:`CHECKPOINT`, :data:`OFFLOAD`
    and :data:`SELECTIVE`.

    Lines for a choice that was not profiled (offload off the GPU, selective
    checkpointing where not searched) are the kept run's, or absent past the last one
    profiled; :class:`PrecisionProfile` says which were.
    """

    key: PhaseKey
    block: int | None
    """The block whose choice (kept, checkpointed, ...) changes this phase, or ``None``."""
    delta: tuple[Line, ...]
    peak: tuple[Line, ...]
    grads: int
    """Gradient bytes alive when the phase begins (for the memory breakdown)."""
    bends: tuple[tuple[Line, ...], ...] = ()
    """More lines under each variant's peak (empty: none): the peak is the largest of
    them and :attr:`peak`. A phase's peak is the most of its live bytes over its ops, each
    linear in the batch size, so it bends where another op's bytes take over: the lines
    of the local maxima that take over at some size (matched between the two profiled
    sizes), and where a third size was profiled (compiled blocks, whose backward bends
    between the smallest sizes), the line through the last two."""

    def rise(self, variant: int, b: float) -> float:
        """The phase's peak above its entry at micro-batch ``b``, block choice ``variant``."""
        top = self.peak[variant](b)
        if variant < len(self.bends):
            for line in self.bends[variant]:
                top = max(top, line(b))
        return top


@dataclass(frozen=True)
class TimeCurve:
    """Seconds of one micro-batch's forward+backward against its size."""

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    ckpt_batch_sizes: tuple[int, ...] = ()
    ckpt_ratio: tuple[float, ...] = ()
    """Extra time with every block checkpointed, as a fraction of ``seconds``."""
    selective_ratio: tuple[float, ...] = ()
    """Extra time with every block checkpointed selectively, at ``ckpt_batch_sizes``, as
    a fraction of ``seconds`` (empty: not profiled)."""

    def fwd_bwd(self, b: int) -> float:
        """Interpolated piecewise-linearly; past the ends, at the nearest end's per-sample cost."""
        xs, ys = self.batch_sizes, self.seconds
        if b <= xs[0]:
            return ys[0] * b / xs[0] if b < xs[0] and xs[0] > 1 else ys[0]
        if b >= xs[-1]:
            return ys[-1] * b / xs[-1]
        i = bisect.bisect_left(xs, b)
        w = (b - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])

    def recompute(self, b: int) -> float:
        """Extra seconds of one micro-batch when every block is checkpointed."""
        return self._extra(b, self.ckpt_ratio)

    def selective(self, b: int) -> float:
        """Extra seconds of one micro-batch when every block is checkpointed selectively."""
        return self._extra(b, self.selective_ratio)

    def _extra(self, b: int, ratios: Sequence[float]) -> float:
        """``ratios`` (at ``ckpt_batch_sizes``) interpolated in log size, times the pass."""
        if not self.ckpt_batch_sizes or not ratios:
            return 0.0
        xs = [math.log(x) for x in self.ckpt_batch_sizes]
        x = math.log(b)
        if x <= xs[0] or len(xs) == 1:
            ratio = ratios[0]
        elif x >= xs[-1]:
            ratio = ratios[-1]
        else:
            i = bisect.bisect_left(xs, x)
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            ratio = ratios[i - 1] + w * (ratios[i] - ratios[i - 1])
        return max(ratio, 0.0) * self.fwd_bwd(b)


Segment = tuple[int, int, bool, bool, tuple[tuple[int, bool], ...]]
"""A caching allocator's segment: (address, stream, small pool, expandable, its blocks'
(size, allocated) in address order)."""


@dataclass(frozen=True)
class Crossing:
    """A tensor made in a block's forward, or that a block takes as an argument or returns,
    whose end differs with the blocks' choices: a decoder's embedding output or rotary
    tables, a UNet's skip connections, a CNN block's output, a weight's cast. A
    checkpointed block holds its arguments until its backward, a kept one what its ops
    saved; one that saved nothing of it leaves it to Python, which may drop it between
    blocks. A uniform run shows one of those ends; the cost model moves the tensor's free
    to where the mask's own holders let go of it (see :meth:`MemoryModel._moved_frees`).

    Per variant (indexed like :attr:`Phase.delta`), as that variant's run (every block
    one way) showed it.
    """

    micro: int
    """The micro-batch (1 or 2) it is made and freed in."""
    size: Line
    """Its bytes."""
    ends: tuple[int, ...]
    """The index of the phase of its micro-batch it is freed in (the number of phases:
    not within the micro-batch)."""
    early: tuple[bool, ...]
    """Whether it is freed before that phase's peak."""
    holders: tuple[tuple[int, ...], ...]
    """The blocks holding it until their backward: as their argument (checkpointed
    variants), or saved for it by their own ops (kept); empty: not known but through
    where it is freed (offloaded, or a profile made before kept holders were recorded)."""
    dropped: int | None = None
    """The index of the phase in which Python let go of it, in the kept run (the number
    of phases: not within the micro-batch; ``None``: not recorded)."""
    maker: int | None = None
    """The block whose forward made it, where it is neither a block's argument nor its
    output (a weight's cast under autocast, which a kept block saves until its backward
    and a checkpointed one leaves to autocast's cache until the forward ends): where no
    block holds it, it ends where the run of its maker's own choice ended it. ``None``:
    an argument or an output."""

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Crossing:
        return Crossing(
            d["micro"],
            Line(**d["size"]),
            tuple(d["ends"]),
            tuple(d["early"]),
            tuple(tuple(h) for h in d["holders"]),
            d.get("dropped"),
            d.get("maker"),
        )


@dataclass(frozen=True)
class Requests:
    """A tracked step's requests to the caching allocator, in order, each allocation's
    bytes against the micro-batch size: the allocator's model replays them at any size
    (:func:`autotune.device.reserved_beyond`) to give what it reserves beyond them."""

    settings: str
    """``PYTORCH_CUDA_ALLOC_CONF`` of the profiled run."""
    start: tuple[Segment, ...]
    """The allocator's segments as the step began (its cached segments given back)."""
    sizes: tuple[Line, ...]
    """Each allocation's requested bytes."""
    streams: tuple[int, ...]
    """Each allocation's stream."""
    order: tuple[int, ...]
    """``i``: allocation ``i`` is made; ``-1 - i``: it is freed."""
    held: int = 0
    """Live bytes of the run as the step began (the tracker's count)."""
    foreign: int = 0
    """Reserved bytes not the run's (the user's own model on the device)."""
    cuts: tuple[int, ...] = ()
    """Where the first micro-batch, the second and the optimizer step begin in
    :attr:`order` (empty: not cut)."""

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Requests:
        return Requests(
            d["settings"],
            _segments(d["start"]),
            tuple(Line(**v) for v in d["sizes"]),
            tuple(d["streams"]),
            tuple(d["order"]),
            d.get("held", 0),
            d.get("foreign", 0),
            tuple(d.get("cuts", ())),
        )


@dataclass(frozen=True)
class PrecisionProfile:
    """What one timeline costs (a precision, compiled or not, its loss chunked or not)."""

    timeline: Timeline
    base_bytes: int
    """Live bytes at step start without optimizer state (parameters, buffers, scaler)."""
    phases: tuple[Phase, ...]
    """Micro-batch 1 (gradients being created), then 2 (gradients accumulating)."""
    time: TimeCurve | None = None
    reserve: tuple[Line, ...] = ()
    """A caching allocator's (CUDA's) reserved peak beyond the live peak, per variant (as
    a phase's lines), fitted over the profiled micro-batch sizes (empty: none)."""
    moved: tuple[Line, ...] = ()
    """Bytes each block's forward sends to the host when offloaded (empty: not profiled)."""
    copies: tuple[tuple[Line, ...], ...] = ()
    """The bytes of each host copy an offloaded block's forward makes, per block: the host
    allocator takes each one rounded (empty: not profiled)."""
    selective: bool = False
    """Whether the selectively checkpointed variant was profiled."""
    requests: tuple[Requests | None, ...] = ()
    """A caching allocator's requests in a tracked step of each variant (as a phase's
    lines; ``None`` or empty: not recorded, :attr:`reserve` stands)."""
    crossings: tuple[Crossing, ...] = ()
    """Tensors whose free a mixed mask moves (empty: none, or not recorded)."""


@dataclass(frozen=True)
class StepRequests:
    """An optimizer's step as the caching allocator saw it: the segments a training step
    with it begins with (the parameters, buffers and its state, nothing cached) and the
    requests its ``optimizer.step()`` makes and frees, in order. The allocator's model
    replays them in place of the profiled optimizer's
    (:func:`autotune.device.reserved_beyond`)."""

    start: tuple[Segment, ...]
    sizes: tuple[int, ...]
    """Each allocation's requested bytes (the step's are the parameters': no line)."""
    streams: tuple[int, ...]
    order: tuple[int, ...]
    """``i``: allocation ``i`` is made; ``-1 - i``: it is freed."""

    @staticmethod
    def from_dict(d: dict[str, Any]) -> StepRequests:
        return StepRequests(
            _segments(d["start"]), tuple(d["sizes"]), tuple(d["streams"]), tuple(d["order"])
        )


@dataclass(frozen=True)
class OptimizerProfile:
    """What one optimizer costs."""

    name: str
    state_bytes: int
    step_peak_bytes: int
    """Transient bytes above the step's start during ``optimizer.step()``."""
    step_s: float
    host_step_s: float | None = None
    """Seconds of the step on the host, transfers excluded (``None``: not profiled)."""
    requests: StepRequests | None = None
    """Its step's requests to a caching allocator (``None``: not recorded)."""

    @staticmethod
    def from_dict(d: dict[str, Any]) -> OptimizerProfile:
        given = d.get("requests")
        return OptimizerProfile(
            **{**d, "requests": None if given is None else StepRequests.from_dict(given)}
        )


@dataclass(frozen=True)
class Profile:
    """Everything the cost model needs, measured on the target."""

    device_type: str
    blocks: tuple[str, ...]
    block_weights: tuple[float, ...]
    """Each block's share of the blocks' forward time (sums to 1)."""
    param_bytes: int
    grad_bytes: int
    precisions: dict[Timeline, PrecisionProfile]
    """Each timeline's costs (saved as ``precisions``, by each timeline's name)."""
    optimizers: dict[str, OptimizerProfile]
    context_bytes: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = ()
    block_bytes: tuple[int, ...] = ()
    """Parameter bytes of each block (empty: blocks taken as equal)."""
    transfer: Transfer | None = None
    """Host<->device copy speeds and host memory for offload (``None``: offload not profiled)."""
    host_param_bytes: int = 0
    """Host bytes of an offloaded optimizer's master weights and gradient buffers, as the
    host allocator takes them (0: not profiled)."""
    host_is_device: bool = False
    """Host memory is this device's memory (the CPU): offload moves bytes, saves none."""
    input_bytes_per_sample: float = 0.0
    """Device bytes of one sample of the input batch where it already lives on the device
    (the whole step's batch is held through the step; 0: it is copied up per micro-batch)."""
    comm: Collectives | None = None
    """The process group's collectives (``None``: measured in one process)."""
    sharded: dict[Timeline, PrecisionProfile] = dataclasses.field(default_factory=dict)
    """Timelines with the parameters in the precision's dtype (FSDP2's mixed precision),
    by timeline (empty: not profiled)."""
    layout: tuple[tuple[int, int, int, int, int], ...] = ()
    """Every parameter as ``(unit, rows, bytes per row, element size, trainable)``: its
    block's index (-1: outside the blocks) and what sharding it on its first dimension
    costs (empty: not recorded)."""
    untrainable: tuple[int, ...] = ()
    """Micro-batch sizes the model failed to train on (an error of its own, not out of
    memory, e.g. BatchNorm over one sample): the search leaves them out."""
    written: tuple[str, ...] = ()
    """The buffers a training step writes (BatchNorm's running statistics, counters), by
    qualified name: what a runner with fallbacks copies before each step."""
    input_bytes_widest: tuple[int, ...] = ()
    """Where the batch's layout pads a micro-batch to its widest sample: the device bytes
    of the sample's first 1, 2, ... samples (widest first), each of a step's micro-batches
    (empty: :attr:`input_bytes_per_sample` stands)."""
    snapshot_bytes: int = 0
    """Device bytes of that copy, held through each step of a runner with fallbacks (the
    cost model counts them; 0 where a step writes no buffer, or none is taken)."""
    reserve_cap: int = 0
    """The most the caching allocator may reserve for the run's tensors where the
    profile is tuned: the budget less the context, as the runner caps it (0: uncapped,
    as an estimate without a budget is). Its model replays a step under it."""

    def batch_bytes(self, micro_batch: int, accum: int) -> float:
        """Device bytes of a step's batch of ``accum`` micro-batches of ``micro_batch``."""
        widest = self.input_bytes_widest
        if not widest:
            return self.input_bytes_per_sample * micro_batch * accum
        whole, rest = divmod(micro_batch, len(widest))  # past the sample: it repeats
        return accum * (whole * widest[-1] + (widest[rest - 1] if rest else 0))

    def block_shares(self) -> tuple[float, ...]:
        """Each block's share of the blocks' parameter bytes (sums to 1)."""
        total = sum(self.block_bytes)
        if len(self.block_bytes) != len(self.blocks) or total <= 0:
            return tuple(1.0 / len(self.blocks) for _ in self.blocks)
        return tuple(n / total for n in self.block_bytes)


def profile_to_json(profile: Profile) -> str:
    """The profile as JSON, to keep it with a study and resume without measuring again
    (each timeline by its name, as saved before timelines were typed)."""

    def named(by_timeline: dict[Timeline, PrecisionProfile]) -> dict[str, dict[str, Any]]:
        out = {}
        for timeline, costs in by_timeline.items():
            fields = dataclasses.asdict(costs)
            del fields["timeline"]
            out[str(timeline)] = {"precision": str(timeline), **fields}
        return out

    d = dataclasses.asdict(dataclasses.replace(profile, precisions={}, sharded={}))
    d.update(precisions=named(profile.precisions), sharded=named(profile.sharded))
    return json.dumps(d)


def profile_from_json(text: str) -> Profile:
    """Inverse of :func:`profile_to_json`."""
    d = json.loads(text)

    def lines(values: list[dict[str, float]]) -> tuple[Line, ...]:
        return tuple(Line(**v) for v in values)

    def precision(p: dict[str, Any]) -> PrecisionProfile:
        phases = tuple(
            Phase(
                PhaseKey(*ph["key"]),
                ph["block"],
                lines(ph["delta"]),
                lines(ph["peak"]),
                ph["grads"],
                tuple(lines(v) for v in ph["bends"])
                if "bends" in ph
                else tuple((line,) for line in lines(ph.get("floor", []))),  # before bends
            )
            for ph in p["phases"]
        )
        t = p["time"]
        curve = None if t is None else TimeCurve(**{k: tuple(v) for k, v in t.items()})
        return PrecisionProfile(
            Timeline.named(p["precision"]),
            p["base_bytes"],
            phases,
            curve,
            lines(p["reserve"]),
            lines(p["moved"]),
            tuple(lines(c) for c in p["copies"]),
            p.get("selective", False),
            tuple(None if r is None else Requests.from_dict(r) for r in p.get("requests", ())),
            tuple(Crossing.from_dict(c) for c in p.get("crossings", ())),
        )

    return Profile(
        device_type=d["device_type"],
        blocks=tuple(d["blocks"]),
        block_weights=tuple(d["block_weights"]),
        param_bytes=d["param_bytes"],
        grad_bytes=d["grad_bytes"],
        precisions={Timeline.named(k): precision(v) for k, v in d["precisions"].items()},
        optimizers={k: OptimizerProfile.from_dict(v) for k, v in d["optimizers"].items()},
        context_bytes=d["context_bytes"],
        seconds=d["seconds"],
        notes=tuple(d["notes"]),
        block_bytes=tuple(d["block_bytes"]),
        transfer=None if d["transfer"] is None else Transfer(**d["transfer"]),
        host_param_bytes=d["host_param_bytes"],
        host_is_device=d["host_is_device"],
        input_bytes_per_sample=d["input_bytes_per_sample"],
        comm=_collectives(d.get("comm")),
        sharded={Timeline.named(k): precision(v) for k, v in d.get("sharded", {}).items()},
        layout=tuple(tuple(row) for row in d.get("layout", ())),
        untrainable=tuple(d.get("untrainable", ())),
        input_bytes_widest=tuple(d.get("input_bytes_widest", ())),
        written=tuple(d.get("written", ())),
        snapshot_bytes=d.get("snapshot_bytes", 0),
        reserve_cap=d.get("reserve_cap", 0),
    )


def _segments(saved: list[Any]) -> tuple[Segment, ...]:
    """Segments as JSON gave them back (lists) as the tuples a profile holds."""
    return tuple(
        (a, stream, small, expandable, tuple((n, used) for n, used in blocks))
        for a, stream, small, expandable, blocks in saved
    )


def _collectives(d: dict[str, Any] | None) -> Collectives | None:
    if d is None:
        return None
    lines = {k: Line(**v) for k, v in d.items() if k != "world_size"}
    return Collectives(world_size=d["world_size"], **lines)
