"""Peak memory per rank under data parallelism, from the single-process profile.

The single-process phase timeline gives the activations of every phase at any micro-batch
size; what DDP and FSDP2 change is added phase by phase:

- **DDP** keeps the gradients in persistent buckets (``gradient_as_bucket_view``): the whole
  gradient from the step's start, and no gradient allocated in backward.
- **FSDP2** keeps the parameters, gradients and optimizer state sharded (each parameter
  padded to a multiple of the ranks on its first dimension). Each unit (block) is
  all-gathered into a flat buffer and copied out to its parameters before its forward;
  the flat buffer lives until the next unit's copy-out is over (the root's forward frees
  the last), and a unit resharded after forward is gathered again in backward (the last
  one as the head's gradient reaches it), the one below it prefetched. The first block's
  backward phase ends with the root's own backward, after the block's reduction. The
  unit's full gradients,
  made in the parameter dtype, are copied into a reduce-scatter input (the reduce dtype)
  that lives until the next unit's reduction; the root (the parameters outside the blocks)
  is gathered from the first forward to the end of backward and keeps full gradients
  until then. Each micro-batch reduces its gradients into the sharded ones, a unit's
  full gradients freed once copied into the reduce-scatter's input. bf16 takes
  the timeline measured with bf16 parameters (an embedding's bf16 output changes what
  follows), else autocast's less its bf16 copies of the weights.

Pure arithmetic over the profile; :mod:`autotune.cost._memory_model` is the single-process
case.

Seconds a data-parallel step spends in collectives, from the process group's timings.

FSDP2 gathers every unit before its forward, again before its backward unless it stays
gathered (the root stays gathered), and reduce-scatters every unit's gradients, each
micro-batch. DDP all-reduces the gradients once per step (in the last micro-batch).
On CUDA the collectives run on their own streams, beside compute; on the CPU (gloo)
they block it.

What data parallelism a cost model plans for, and what it makes of each unit's bytes.

:class:`Layout` is the part of a :class:`~autotune.config.TrainConfig` the search does not
turn per setting; :class:`Units` the per-rank sizes of each FSDP2 unit (the blocks, then
the root) at one world size: shards padded to a multiple of the ranks on the first
dimension, as ``fully_shard`` pads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotune._profile_data import Phase, Profile
from autotune.config import TrainConfig
from autotune.cost._knobs import Knobs, Mask
from autotune.cost._memory_model import CHECKPOINT, SELECTIVE, MemoryModel, between
from autotune.result import Breakdown

__all__ = [
    "Layout",
    "Units",
    "comm_seconds",
    "parallel_step_s",
    "per_rank_peak",
    "sharded_memory",
    "sharded_peak",
]


def sharded_peak(model: MemoryModel, config: TrainConfig) -> tuple[int, int, dict[str, int]]:
    """(device peak bytes, live peak bytes, what holds them) of one rank of ``config``."""
    return per_rank_peak(model, Layout.of(config), model.knobs(config))


def per_rank_peak(
    model: MemoryModel, layout: Layout, knobs: Knobs
) -> tuple[int, int, dict[str, int]]:
    """:func:`sharded_peak` of ``knobs`` under ``layout``: what the chooser asks, many
    times, with no config."""
    timeline, micro_batch, mask = knobs.timeline, knobs.micro_batch, knobs.mask
    prof = model.profile
    opt = prof.optimizers[knobs.optimizer]
    batch = prof.batch_bytes(micro_batch, knobs.accum)
    others = prof.precisions[timeline].base_bytes - prof.param_bytes
    if layout.parallel == "ddp":
        state = opt.state_bytes
        start = prof.precisions[timeline].base_bytes + state + batch + prof.grad_bytes
        later = [ph for ph in prof.precisions[timeline].phases if ph.key.micro == 2]
        live, peak = _ddp(later, knobs, model)
        step = opt.step_peak_bytes
        parts = {"parameters": prof.param_bytes, "gradients": prof.grad_bytes, "optimizer": state}
    else:
        sharded = prof.sharded.get(timeline)  # measured with the parameters in bf16, as FSDP has
        units = Units.of(prof, layout.world_size, timeline.precision, cast=sharded is not None)
        ratio = sum(units.grad_shard) / prof.grad_bytes if prof.grad_bytes else 0.0
        state = math.ceil(opt.state_bytes * ratio)
        params = sum(units.shard)
        grads = sum(units.grad_shard)
        if knobs.offload_optimizer and not prof.host_is_device:
            state = params = grads = 0  # FSDP's CPUOffloadPolicy: all three on the host
        start = others + params + state + batch
        every = (sharded or prof.precisions[timeline]).phases
        casts = sharded is None and timeline.precision != "fp32"  # autocast's over fp32
        fsdp = _Fsdp(units, layout, model, mask, micro_batch, grads, casts=casts)
        live, peak = fsdp.replay([ph for ph in every if ph.key.micro == 1], knobs.accum, every)
        step = 0 if knobs.offload_optimizer else math.ceil(opt.step_peak_bytes * ratio)
        parts = {"parameters": params, "gradients": grads, "optimizer": state}
    # In a step, a fallback's copy of the buffers it writes; between steps, a loader's
    # next batch made beside this one.
    peak = max(peak + prof.snapshot_bytes, live + step + prof.snapshot_bytes, batch)
    live_peak = math.ceil(start + peak)
    return (
        model.device_bytes(
            live_peak, timeline, micro_batch, model.variant_shares(mask), knobs.accum
        ),
        live_peak,
        parts,
    )


def sharded_memory(model: MemoryModel, config: TrainConfig) -> tuple[int, Breakdown]:
    """Predicted peak device bytes of one rank of ``config`` and what holds them."""
    device_peak, live_peak, parts = sharded_peak(model, config)
    prof = model.profile
    batch = math.ceil(prof.batch_bytes(config.micro_batch_size, config.grad_accum_steps))
    other = prof.precisions[config.timeline].base_bytes - prof.param_bytes + batch
    held = parts["parameters"] + parts["gradients"] + parts["optimizer"]
    acts = max(live_peak - held - other, 0)
    return device_peak, Breakdown(
        parameters=parts["parameters"],
        gradients=parts["gradients"],
        optimizer=parts["optimizer"],
        activations=acts,
        other=device_peak - held - acts,
    )


def _rise_delta(ph: Phase, mask: Mask, b: int, model: MemoryModel) -> tuple[float, float]:
    """A phase's peak above its entry and its net change, each block's variant as masked."""
    if ph.block is not None:
        v = int(mask[ph.block])
        return ph.rise(v, b), ph.delta[v](b)
    return between(ph, b, model.variant_shares(mask))


def _ddp(phases: list[Phase], knobs: Knobs, model: MemoryModel) -> tuple[float, float]:
    """(live at the end, peak) above the start. The gradients are in the buckets from the
    start, so every micro-batch accumulates into them as the single process's second does."""
    live = peak = 0.0
    for _ in range(knobs.accum):
        for ph in phases:
            rise, delta = _rise_delta(ph, knobs.mask, knobs.micro_batch, model)
            peak = max(peak, live + rise)
            live += delta
    return live, peak


class _Fsdp:
    """The FSDP2 replay: single-process activations plus the units' buffers."""

    def __init__(
        self,
        units: Units,
        layout: Layout,
        model: MemoryModel,
        mask: Mask,
        b: int,
        grads: int,
        *,
        casts: bool = True,
    ) -> None:
        self.u, self.model, self.mask, self.b = units, model, mask, b
        self.k = len(units.shard) - 1
        blocks = model.profile.blocks
        self.kept = [blocks[i] in layout.keep_gathered for i in range(self.k)]
        self.grads = grads
        # bf16 autocast keeps a bf16 copy of each block's weights from its forward in the
        # single-process profile: a kept block's until its backward, a checkpointed one's
        # until the forward ends (and again while it recomputes). FSDP's bf16 parameters
        # are that copy. ``casts``: the timeline is such an autocast's.
        self.casts = [units.grad_full[i] if casts else 0 for i in range(self.k)]
        # Recomputed blocks (selectively too: a cast is a cheap op) drop their copies early.
        recomputed = (CHECKPOINT, SELECTIVE)
        self.released = sum(c for c, m in zip(self.casts, mask, strict=True) if m in recomputed)

    def replay(
        self, phases: list[Phase], accum: int, every: tuple[Phase, ...]
    ) -> tuple[float, float]:
        """(live at the end, peak) above the step's start. Micro-batches after the first
        repeat the second (the gradients sharded already); a net growth compounds."""
        # A block's backward in the single process's second micro-batch: its transients
        # without the gradients being kept, the part of the rise that grows with the size.
        later = {ph.block: ph for ph in every if ph.key.micro == 2 and ph.key.label == "bwd"}
        peak, acts = self._micro(phases, later, 0, 0.0)
        if accum >= 2:
            top, end = self._micro(phases, later, 1, acts)
            net = end - acts
            peak = max(peak, top + (accum - 2) * max(net, 0.0))
            acts = end + (accum - 2) * net
        return acts + self.grads, peak

    def _micro(
        self, phases: list[Phase], later: dict[int | None, Phase], m: int, acts: float
    ) -> tuple[float, float]:
        """(peak, activations after) of micro-batch ``m`` (0: the first) from ``acts``."""
        u, k = self.u, self.k
        peak = 0.0
        sharded = self.grads if m else 0.0
        done = 0  # blocks whose backward is over, from the top
        for j, ph in enumerate(phases):
            if m and ph.key.label == "start":
                continue
            rise, delta = _rise_delta(ph, self.mask, self.b, self.model)
            if ph.block is not None:
                cast = self.casts[ph.block]
                if ph.key.label == "fwd":
                    rise, delta = rise - cast, delta - cast
                elif self.mask[ph.block] in (CHECKPOINT, SELECTIVE):  # backward: recomputed
                    rise -= cast
                else:  # backward: the single process frees its copy
                    delta += cast
            elif ph.key.label == "after" and ph.key.block == k - 1:
                delta += self.released  # where the single process's autocast drops its copies
            nxt = phases[j + 1].grads if j + 1 < len(phases) else ph.grads
            made = max(nxt - ph.grads, 0)
            finished = range(k - done, k)
            single = sum(u.grad_single[i] for i in finished)
            scale = u.grad_full[k] / u.grad_single[k] if u.grad_single[k] else 1.0
            root = max(ph.grads - single, 0) * scale
            held = sharded + (0 if m else sum(u.grad_shard[i] for i in finished)) + root
            if ph.key.label == "end":  # the root has reduced too: all sharded
                held = self.grads
            base = acts + held
            label, i = ph.key.label, ph.key.block
            if label == "bwd" and i is not None:
                scale_i = u.grad_full[i] / u.grad_single[i] if u.grad_single[i] else 1.0
                full = made * scale_i  # this unit's gradients, in the parameter dtype
                if i in later:
                    rise = max(rise, _rise_delta(later[i], self.mask, self.b, self.model)[0])
                hold = self._hold_bwd(i)
                # The first block's phase ends with the root's own backward (the
                # embeddings' gradients), after the block's reduction has freed its buffers.
                outside = max(made - u.grad_single[i], 0) if i == 0 else 0
                compute = base + hold + rise - made + full - outside
                # Its reduce-scatter: resharded, the previous input freed, its own taken and
                # its output; its full gradients, copied into the input, freed.
                scatter = base + delta - made + full + hold - u.gathered[i]
                scatter += -self._prev_reduce(i) + u.reduce[i] + u.grad_shard[i] - u.grad_full[i]
                peak = max(peak, compute, scatter)
                if i == 0:  # the root reduces last: the first unit's input and gradients
                    # freed (and its output, once accumulated), the root's input taken
                    kept = 0 if m else u.grad_shard[i]
                    root = scatter - u.reduce[i] - full + kept + u.reduce[k]
                    peak = max(peak, root)
                done += 1
            else:
                peak = max(peak, base + self._hold(label, i) + rise)
            acts += delta - made
        return peak, acts

    def _kept(self, below: int) -> int:
        return sum(self.u.gathered[i] for i in range(below) if self.kept[i])

    def _hold(self, label: str, i: int | None) -> float:
        """Gathered bytes a phase other than a block's backward holds at its peak."""
        g, k = self.u.gathered, self.k
        # A unit's copy-out runs while the unit before it still holds its flat buffer
        # (FSDP2 frees it when the copy-out returns): two flat buffers and the copy.
        if label == "pre":  # the root gathered (flat and copied out), then the first unit
            return 2 * g[k] + (2 * g[0] if k else 0)
        if label == "fwd" and i is not None:
            return g[k] + 2 * g[i] + self._kept(i)
        if label == "after" and i is not None:
            nxt = g[i + 1] if i + 1 < k else 0
            return g[k] + g[i] + self._kept(i + 1) + 2 * nxt
        if label == "head_bwd":  # the root's forward freed the last flat buffer; the last
            # unit is gathered again as the head's gradient reaches it
            again = g[k - 1] if k and not self.kept[k - 1] else 0
            return g[k] + self._kept(k) + again
        return 0.0  # start, end: nothing gathered

    def _prev_reduce(self, i: int) -> int:
        return self.u.reduce[i + 1] if i + 1 < self.k else 0

    def _hold_bwd(self, i: int) -> float:
        """Gathered and reduce buffers while unit ``i``'s backward runs."""
        g = self.u.gathered
        prefetch = g[i - 1] if i >= 1 and not self.kept[i - 1] else 0
        return g[self.k] + g[i] + prefetch + self._prev_reduce(i) + self._kept(i)


def comm_seconds(profile: Profile, config: TrainConfig) -> float | None:
    """Collective seconds per optimizer step of one rank; ``None`` when the collectives
    were not measured at this world size (planned in one process)."""
    comm = profile.comm
    if config.parallel == "none":
        return 0.0
    if comm is None or comm.world_size != config.world_size:
        return None
    if config.parallel == "ddp":
        return comm.all_reduce(profile.grad_bytes)
    units = Units.of(profile, config.world_size, config.precision)
    k = len(profile.blocks)
    kept = {i for i, name in enumerate(profile.blocks) if name in config.keep_gathered}
    per_micro = sum(comm.all_gather(g) for g in units.gathered)
    per_micro += sum(comm.all_gather(units.gathered[i]) for i in range(k) if i not in kept)
    per_micro += sum(comm.reduce_scatter(r) for r in units.reduce if r)
    return per_micro * config.grad_accum_steps


def parallel_step_s(compute_s: float, comm_s: float, device_type: str) -> float:
    """A step's seconds from its compute and its collectives: beside each other on CUDA's
    streams, one after the other on the CPU."""
    return max(compute_s, comm_s) if device_type == "cuda" else compute_s + comm_s


_PARAM_DTYPE_BYTES = {"bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    """The data parallelism a cost model plans for: the knobs of :class:`TrainConfig`
    that the search does not turn per setting."""

    parallel: str = "none"
    world_size: int = 1
    keep_gathered: tuple[str, ...] = ()

    @staticmethod
    def of(config: TrainConfig) -> Layout:
        """The layout ``config`` trains under."""
        return Layout(config.parallel, config.world_size, config.keep_gathered)

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` trained this way."""
        if self.parallel == "none":
            return config
        return config.replace(
            parallel=self.parallel,
            world_size=self.world_size,
            keep_gathered=self.keep_gathered,
        )

    def describe(self) -> str:
        kept = f", {len(self.keep_gathered)} units kept gathered" if self.keep_gathered else ""
        return f"{self.parallel} x {self.world_size}{kept}"


@dataclass(frozen=True)
class Units:
    """Bytes of each FSDP unit (the blocks, then the root) at one world size."""

    shard: tuple[int, ...]
    """Sharded parameters per rank, padded."""
    gathered: tuple[int, ...]
    """All-gathered parameters (the flat buffer), in the parameter dtype."""
    grad_shard: tuple[int, ...]
    """Sharded gradients per rank (trainable parameters only)."""
    grad_full: tuple[int, ...]
    """The unit's full gradients, in the parameter dtype."""
    grad_single: tuple[int, ...]
    """The unit's gradients in the single-process profile."""
    reduce: tuple[int, ...]
    """The reduce-scatter input: full, padded gradients in the reduce dtype."""

    @staticmethod
    def of(profile: Profile, world: int, precision: str, *, cast: bool = False) -> Units:
        """``cast``: the single-process timeline had its parameters (and so its gradients)
        in the precision's dtype too."""
        k = len(profile.blocks)
        sizes = [[0] * (k + 1) for _ in range(6)]
        for unit, rows, row, item, trainable in profile.layout:
            u = unit if unit >= 0 else k
            padded = math.ceil(rows / world)
            scale = _PARAM_DTYPE_BYTES.get(precision, item) / item
            sizes[0][u] += padded * row
            sizes[1][u] += math.ceil(padded * world * row * scale)
            if trainable:
                sizes[2][u] += padded * row
                sizes[3][u] += math.ceil(rows * row * scale)
                sizes[4][u] += math.ceil(rows * row * scale) if cast else rows * row
                sizes[5][u] += padded * world * row
        return Units(*(tuple(s) for s in sizes))
