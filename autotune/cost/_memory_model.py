"""Peak device memory of any configuration: the profiled phase timeline, replayed.

Micro-batch 1, micro-batch 2 repeated ``grad_accum_steps - 1`` times, then the optimizer
step, with the step's input batch held throughout where it lives on the device, and
after the step the next batch, which a loader makes while the last one is held. Each
block's phases are taken from its kept, checkpointed or offloaded variant and each
quantity is evaluated at the micro-batch size. Pure arithmetic over the profile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from autotune._profile_data import (
    CHECKPOINT,
    KEEP,
    OFFLOAD,
    SELECTIVE,
    Crossing,
    Line,
    Phase,
    Profile,
    Requests,
    StepRequests,
)
from autotune.config import Timeline, TrainConfig
from autotune.cost._knobs import Knobs, Mask
from autotune.device import AllocatorSettings, pinned_bytes, relaid, reserved_beyond
from autotune.result import Breakdown, Costs

__all__ = ["CHECKPOINT", "KEEP", "OFFLOAD", "SELECTIVE", "Mask", "MemoryModel", "ProfileView"]

WRAPPED = (CHECKPOINT, OFFLOAD, SELECTIVE)
"""The choices other than keeping, in the order of :meth:`MemoryModel.variant_shares`."""


class ProfileView:
    """What the memory and time models share: the profile and its blocks by index."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.n_blocks = len(profile.blocks)
        self._index = {name: i for i, name in enumerate(profile.blocks)}
        self._shares = profile.block_shares()

    def mask_of(
        self, checkpoint: Sequence[str], offload: Sequence[str] = (), selective: Sequence[str] = ()
    ) -> Mask:
        """The mask of checkpointed, offloaded and selectively checkpointed block names."""
        out = [KEEP] * self.n_blocks
        for names, choice in ((checkpoint, CHECKPOINT), (offload, OFFLOAD), (selective, SELECTIVE)):
            for name in names:
                out[self._index[name]] = choice
        return tuple(out)

    def config_mask(self, config: TrainConfig) -> Mask:
        """The mask of ``config``'s block choices."""
        return self.mask_of(
            config.checkpoint, config.offload_activations, config.selective_checkpoint
        )

    def knobs(self, config: TrainConfig) -> Knobs:
        """What the cost model reads of ``config``: its knobs, with its block choices."""
        return Knobs.of(config, self.config_mask(config))


class MemoryModel(ProfileView):
    """Predicts peak device bytes from a :class:`~autotune._profile_data.Profile`."""

    def __init__(self, profile: Profile) -> None:
        super().__init__(profile)
        self._replayed: dict[tuple[Timeline, int, int, int, str | None], int] = {}
        self._moves: dict[tuple[Timeline, int, Mask], Moves | None] = {}
        self._micro = {
            name: (
                tuple(ph for ph in prec.phases if ph.key.micro == 1),
                tuple(ph for ph in prec.phases if ph.key.micro == 2),
            )
            for name, prec in profile.precisions.items()
        }

    def peak_of(self, knobs: Knobs) -> int:
        """Predicted peak device bytes of ``knobs``."""
        return self.peaks_of(knobs)[0]

    def peaks_of(self, knobs: Knobs) -> tuple[int, int, int]:
        """(device peak bytes, live peak bytes, gradient bytes at the peak) of ``knobs``."""
        if knobs.offload_optimizer and self.profile.host_is_device:
            # The CPU: state, gradients and the step's transient are the same bytes on the
            # "host", plus the master weights of the trained parameters (a frozen one, a
            # LoRA base, has none; an offloaded block's host copies are in its measured
            # variant already).
            on_device = dataclasses.replace(knobs, offload_optimizer=False)
            device, live_peak, held = self.peaks_of(on_device)
            masters = self.profile.grad_bytes
            return device + masters, live_peak + masters, held
        timeline, accum, mask = knobs.timeline, knobs.accum, knobs.mask
        micro_batch, offload_optimizer = knobs.micro_batch, knobs.offload_optimizer
        first, later = self._micro[timeline]
        opt = self.profile.optimizers[knobs.optimizer]
        state = 0 if offload_optimizer else opt.state_bytes
        shares = self.variant_shares(mask)
        moved = self.profile.precisions[timeline].moved
        start = float(self.profile.precisions[timeline].base_bytes + state)
        batch = self.profile.batch_bytes(micro_batch, accum)
        start += batch  # the step's batch, held through the step
        between_steps = start + batch  # a loader makes the next batch while this one is held
        start += self.profile.snapshot_bytes  # a fallback's copy of the written buffers
        # An offloaded optimizer takes each gradient off the device in the last micro-batch.
        release = _released(first) if offload_optimizer else None
        moves = self._moved_frees(timeline, 1, mask), self._moved_frees(timeline, 2, mask)
        peak, live, grads = self._replay(
            first, start, micro_batch, mask, shares, moved, release if accum == 1 else None,
            moves[0],
        )  # fmt: skip
        if accum >= 2:
            top, end, grads2 = self._replay(
                later, live, micro_batch, mask, shares, moved, None, moves[1]
            )
            # Micro-batches 2..accum repeat micro-batch 2; a net growth would compound.
            net = end - live
            top += (accum - 2) * max(net, 0.0)
            if top > peak:
                peak, grads = top, grads2
            live += (accum - 2) * net
            if release is not None:  # the last micro-batch sends the gradients down
                top, end, grads2 = self._replay(
                    later, live, micro_batch, mask, shares, moved, release, moves[1]
                )
                if top > peak:
                    peak, grads = top, grads2
                live = end
            else:
                live += net
        if offload_optimizer:
            live -= self.profile.grad_bytes
        elif live + opt.step_peak_bytes > peak:
            peak, grads = live + opt.step_peak_bytes, self.profile.grad_bytes
        if between_steps > peak:
            peak, grads = between_steps, 0
        live_peak = math.ceil(max(peak, start))
        device = self.device_bytes(
            live_peak, timeline, micro_batch, shares, accum, optimizer=knobs.optimizer
        )
        return device, live_peak, grads

    def _moved_frees(self, timeline: Timeline, micro: int, mask: Mask) -> Moves | None:
        """What each phase of micro-batch ``micro`` gains in (delta, rise) where ``mask``
        frees a :class:`~autotune._profile_data.Crossing` elsewhere than the replay of
        its phases does (each phase frees it as much as the runs it is taken from did);
        ``None``: nothing moves."""
        key = (timeline, micro, mask)
        if key not in self._moves:
            phases = self._micro[timeline][micro - 1]
            every = self.profile.precisions[timeline].crossings
            crossings = [c for c in every if c.micro == micro]
            self._moves[key] = _moves(phases, crossings, mask, self.variant_shares(mask))
        return self._moves[key]

    def variant_shares(self, mask: Mask) -> tuple[float, ...]:
        """Parameter shares of the blocks of each choice of :data:`WRAPPED` (checkpointed,
        offloaded, selectively checkpointed)."""
        return tuple(
            sum(w for w, m in zip(self._shares, mask, strict=True) if m == v) for v in WRAPPED
        )

    @staticmethod
    def _replay(
        phases: Sequence[Phase],
        live: float,
        b: int,
        mask: Mask,
        shares: tuple[float, ...],
        moved: Sequence[Line],
        release: Sequence[int] | None,
        moves: Moves | None = None,
    ) -> tuple[float, float, int]:
        """Replay one micro-batch from ``live`` bytes: (peak, live after, grads at peak).

        ``release``: gradient bytes already sent to the host as each phase begins (the
        last micro-batch of an offloaded optimizer), or ``None``. ``moves``: what each
        phase's (delta, rise) gains where the mask moves a tensor's free
        (:meth:`_moved_frees`).
        """
        peak, grads = live, 0
        offloaded = [i for i, m in enumerate(mask) if m == OFFLOAD]
        freed = 0
        for j, ph in enumerate(phases):
            if release is not None:  # gradients leave as they are made
                live -= release[j] - freed
                freed = release[j]
            if ph.block is not None:
                v = int(mask[ph.block])
                if v == OFFLOAD and ph.key.label == "bwd":
                    live += _restores(ph.block, offloaded, moved, b)
                rise, delta = ph.rise(v, b), ph.delta[v](b)
            else:  # between blocks: in proportion to each choice's share of the blocks
                rise, delta = between(ph, b, shares)
            if moves is not None:
                rise, delta = rise + moves[j][1](b), delta + moves[j][0](b)
            if live + rise > peak:
                peak, grads = live + rise, ph.grads - freed
            live += delta
        return peak, live, grads

    def device_bytes(
        self,
        live_bytes: int,
        timeline: Timeline,
        b: int,
        shares: tuple[float, ...],
        accum: int = 2,
        *,
        optimizer: str | None = None,
    ) -> int:
        """Live tensor bytes to device bytes: on CUDA, what the caching allocator reserves
        beyond them at micro-batch ``b`` with ``accum`` micro-batches a step (each
        variant's, weighted by the ``shares`` of :meth:`variant_shares` as between
        blocks), and the context; with ``optimizer``'s step where it is not the profiled
        one (``None``: the profiled one's)."""
        prec = self.profile.precisions[timeline]
        if not prec.reserve and not prec.requests:
            return live_bytes + self.profile.context_bytes
        kept = self._beyond(timeline, KEEP, b, accum, optimizer)
        beyond = kept
        for share, v in zip(shares, WRAPPED, strict=True):
            if share:
                beyond += share * (self._beyond(timeline, v, b, accum, optimizer) - kept)
        return live_bytes + max(math.ceil(beyond), 0) + self.profile.context_bytes

    def other_allocator_mode(self, config: TrainConfig) -> tuple[str, int, int] | None:
        """The other ``expandable_segments`` setting than the profile ran with, and the
        peak device bytes of ``config`` the allocator's model predicts with the profiled
        setting and with that one (``None``: no requests were recorded)."""
        knobs = self.knobs(config)
        prec = self.profile.precisions[knobs.timeline]
        requests = [r for r in prec.requests if r is not None]
        if not requests:
            return None
        settings = AllocatorSettings.parse(requests[0].settings)
        other = "expandable_segments:" + ("False" if settings.expandable_segments else "True")
        now = self.peaks_of(knobs)[0]
        flipped = MemoryModel(self._with_settings(knobs.timeline, other))
        return other, now, flipped.peaks_of(knobs)[0]

    def _with_settings(self, timeline: Timeline, settings: str) -> Profile:
        """The profile with ``precision``'s requests replayed under ``settings`` (the
        allocator's other keys kept), the run's lasting tensors laid out under them."""
        prec = self.profile.precisions[timeline]
        requests = tuple(
            None
            if r is None
            else dataclasses.replace(
                r,
                settings=f"{r.settings},{settings}",
                start=tuple(relaid(r.start, f"{r.settings},{settings}")),
            )
            for r in prec.requests
        )
        changed = dataclasses.replace(prec, requests=requests)
        return dataclasses.replace(
            self.profile, precisions={**self.profile.precisions, timeline: changed}
        )

    def _beyond(
        self, timeline: Timeline, v: int, b: int, accum: int, optimizer: str | None = None
    ) -> float:
        """What the allocator reserves beyond the live bytes in a step of variant ``v`` at
        micro-batch ``b`` with ``accum`` micro-batches: its model fed the step's requests
        where they were recorded (the allocator's rules at this very size; ``optimizer``'s
        step and state where they were recorded too), else the line fitted over the
        profiled sizes (a variant not profiled: the kept run's)."""
        prec = self.profile.precisions[timeline]
        requests = prec.requests[v] if v < len(prec.requests) else None
        if requests is None and prec.requests:
            requests = prec.requests[KEEP]
        if requests is not None:
            step = self._other_step(requests, optimizer)
            replayed = optimizer if step is not None else None
            key = (timeline, v, b, min(accum, 3), replayed)  # steady from the third
            if key not in self._replayed:
                cap = self.profile.reserve_cap
                self._replayed[key] = reserved_beyond(requests, b, accum, cap, step)
            return self._replayed[key]
        reserve = prec.reserve
        return reserve[v](b) if v < len(reserve) else reserve[KEEP](b)

    def _other_step(
        self, requests: Requests, optimizer: str | None
    ) -> tuple[StepRequests, int] | None:
        """``optimizer``'s recorded step and the live bytes a step of ``requests`` holds
        with its state in place of the profiled optimizer's; ``None`` where it is the
        profiled one (the timelines' own, the first), not given, or not recorded."""
        profiled = next(iter(self.profile.optimizers))
        other = self.profile.optimizers.get(optimizer) if optimizer is not None else None
        if optimizer == profiled or other is None or other.requests is None:
            return None
        state = self.profile.optimizers[profiled].state_bytes
        return other.requests, requests.held - state + other.state_bytes

    def host_bytes(self, config: TrainConfig) -> int:
        """Host bytes offload holds at most: optimizer side and one micro-batch's
        activations, each host buffer as the host allocator takes it."""
        offloaded = Knobs.of(config, self.mask_of((), config.offload_activations))
        return math.ceil(self._host_side(offloaded))

    def _host_side(self, knobs: Knobs) -> float:
        """Host bytes of the offloaded optimizer and of one micro-batch's offloaded blocks
        (those ``knobs`` offload)."""
        prof = self.profile
        micro_batch = knobs.micro_batch
        total = 0.0
        if knobs.offload_optimizer:
            total += prof.host_param_bytes or 2 * prof.grad_bytes
            total += prof.optimizers[knobs.optimizer].state_bytes
        rounds = prof.transfer is not None and prof.transfer.rounds_host
        variant = prof.precisions[knobs.timeline]
        for i in (i for i, m in enumerate(knobs.mask) if m == OFFLOAD):
            if rounds and variant.copies:
                total += sum(pinned_bytes(math.ceil(c(micro_batch))) for c in variant.copies[i])
            else:
                total += variant.moved[i](micro_batch)
        return total

    def costs(self, config: TrainConfig) -> Costs:
        """What each part of ``config`` costs at its own most (one process)."""
        knobs = self.knobs(config)
        prof = self.profile
        opt = prof.optimizers[knobs.optimizer]
        device_peak, live_peak, _ = self.peaks_of(knobs)
        acts = self._activations(knobs, knobs.micro_batch)
        base = prof.precisions[knobs.timeline].base_bytes
        return Costs(
            micro_batch=knobs.micro_batch,
            parameters=prof.param_bytes,
            gradients=prof.grad_bytes,
            optimizer=0 if knobs.offload_optimizer else opt.state_bytes,
            optimizer_step=0 if knobs.offload_optimizer else opt.step_peak_bytes,
            activations=acts,
            activations_per_sample=self._activations(knobs, knobs.micro_batch + 1) - acts,
            batch=math.ceil(prof.batch_bytes(knobs.micro_batch, knobs.accum)),
            other=base - prof.param_bytes + device_peak - live_peak,
        )

    def _activations(self, knobs: Knobs, b: int) -> int:
        """The most the first micro-batch's forward and backward hold at micro-batch ``b``
        above what it began with, less the gradients it has made by then."""
        first, _ = self._micro[knobs.timeline]
        shares = self.variant_shares(knobs.mask)
        moved = self.profile.precisions[knobs.timeline].moved
        moves = self._moved_frees(knobs.timeline, 1, knobs.mask)
        peak, _, grads = self._replay(first, 0.0, b, knobs.mask, shares, moved, None, moves)
        return max(math.ceil(peak - grads), 0)

    def memory(self, config: TrainConfig) -> tuple[int, Breakdown]:
        """Predicted peak device bytes of ``config`` and what holds them at the peak."""
        knobs = self.knobs(config)
        device_peak, live_peak, grads = self.peaks_of(knobs)
        prof = self.profile
        state = 0 if knobs.offload_optimizer else prof.optimizers[knobs.optimizer].state_bytes
        batch = prof.batch_bytes(knobs.micro_batch, knobs.accum)
        base = prof.precisions[knobs.timeline].base_bytes
        other = base - prof.param_bytes + math.ceil(batch)
        if live_peak <= math.ceil(base + state + 2 * batch):
            other += math.ceil(batch)  # the peak is the next batch made beside this one
        else:  # in a step: a fallback's copy of the buffers it writes
            other += prof.snapshot_bytes
        acts = max(live_peak - prof.param_bytes - grads - state - other, 0)
        return device_peak, Breakdown(
            parameters=prof.param_bytes,
            gradients=grads,
            optimizer=state,
            activations=acts,
            other=device_peak - prof.param_bytes - grads - state - acts,
        )


def between(ph: Phase, b: int, shares: tuple[float, ...]) -> tuple[float, float]:
    """(rise, delta) of a phase between blocks at micro-batch ``b``: the kept run's, moved
    toward each choice's run in proportion to its ``shares`` of the blocks (what happens
    between blocks depends on every block's choice, e.g. autocast dropping its weight
    casts when the forward ends)."""
    rise, delta = ph.rise(KEEP, b), ph.delta[KEEP](b)
    for share, v in zip(shares, WRAPPED, strict=True):
        if share:
            rise += share * (ph.rise(v, b) - ph.rise(KEEP, b))
            delta += share * (ph.delta[v](b) - ph.delta[KEEP](b))
    return rise, delta


Moves = tuple[tuple[Line, Line], ...]
"""What each phase of a micro-batch gains in (delta, rise) where a mask moves frees."""


def _moves(
    phases: Sequence[Phase], crossings: Sequence[Crossing], mask: Mask, shares: tuple[float, ...]
) -> Moves | None:
    """See :meth:`MemoryModel._moved_frees`."""
    backward = {ph.block: j for j, ph in enumerate(phases) if ph.key.label == "bwd"}
    if not crossings or len(backward) != sum(ph.key.label == "bwd" for ph in phases):
        return None  # nothing to move, or a block run twice: its backward is not one phase
    if OFFLOAD in mask:  # an offloaded block's frees are its own (see _restores)
        return None
    weights = [_weights(ph, mask, shares) for ph in phases]
    delta = [Line(0.0, 0.0)] * len(phases)
    rise = list(delta)
    for c in crossings:
        end = _end(c, mask, phases, backward)
        if end is None:
            continue
        at, early = end
        if at >= len(phases) > min(c.ends):
            continue  # past the micro-batch, where a run freed it within: not one tensor
        for x in {e for e in (*c.ends, at) if e < len(phases)}:  # elsewhere nothing moves
            w = weights[x]
            here = [v for v, e in enumerate(c.ends) if e == x]
            freed = sum(w[v] for v in here)  # what the replay frees of it here
            gain = freed - (1.0 if at == x else 0.0)
            if at != x:  # freed before the peak where it is taken from, held in truth
                lift = sum(w[v] for v in here if c.early[v])
            else:
                lift = -sum(w[v] for v in range(len(c.ends)) if v not in here) if early else 0.0
            delta[x] = delta[x] + _scaled(c.size, gain)
            rise[x] = rise[x] + _scaled(c.size, lift)
    return tuple(zip(delta, rise, strict=True))


def _weights(ph: Phase, mask: Mask, shares: tuple[float, ...]) -> list[float]:
    """How much of each variant's run the replay takes this phase from."""
    n = len(ph.delta)
    if ph.block is not None:
        return [1.0 if v == mask[ph.block] else 0.0 for v in range(n)]
    out = [0.0] * n
    out[KEEP] = 1.0 - sum(shares)
    for share, v in zip(shares, WRAPPED, strict=True):
        if v < n:
            out[v] = share
    return out


def _end(
    c: Crossing, mask: Mask, phases: Sequence[Phase], backward: dict[int | None, int]
) -> tuple[int, bool] | None:
    """Where ``c`` is freed under ``mask`` (the phase's index; whether before its peak):
    where the last of the mask's blocks that hold it lets go, or where Python drops it
    (a run in which no block held it shows where, else the kept run's record of where
    Python let go of it); ``None``: not known."""
    releases = []
    dropped = None
    for v, at in enumerate(c.ends):
        if v == OFFLOAD:  # frees what it saved as its forward ends, whoever holds it
            continue
        # Its holders, and the block whose backward freed it in this run: a selectively
        # checkpointed block keeps the output of its last (expensive) op, the next
        # block's argument, until its own backward.
        held = tuple(dict.fromkeys((*c.holders[v], *_freeing(phases, at))))
        if not held:  # Python's to drop: where the maker's choice's run did, if known
            if c.maker is None or mask[c.maker] == v:
                dropped = dropped or (at, c.early[v])
            continue
        if any(j not in backward for j in held):
            return None
        past = at - max(backward[j] for j in held)  # how far after the backward it goes
        releases += [(backward[j] + past, c.early[v]) for j in held if mask[j] == v]
    if dropped is None and c.dropped is not None:  # where Python let go, no run freeing it there
        dropped = (c.dropped, True)
    if dropped is not None:
        releases.append(dropped)
    return max(releases) if releases else None


def _freeing(phases: Sequence[Phase], at: int) -> tuple[int, ...]:
    """The block whose backward phase ``at`` is, alone (a kept block's saved tensors let
    go there), or none."""
    block = phases[at].block if at < len(phases) else None
    return (block,) if block is not None and phases[at].key.label == "bwd" else ()


def _scaled(line: Line, k: float) -> Line:
    return Line(line.const * k, line.slope * k)


def _released(phases: Sequence[Phase]) -> list[int]:
    """Gradient bytes made before each phase of a micro-batch (sent down when offloaded)."""
    return [ph.grads for ph in phases]


def _restores(block: int, offloaded: Sequence[int], moved: Sequence[Line], b: int) -> float:
    """Bytes brought back to the device as offloaded ``block``'s backward begins.

    The top offloaded block restores itself; every offloaded block prefetches the next
    offloaded block below it.
    """
    total = 0.0
    if block == offloaded[-1]:
        total += moved[block](b)
    below = [j for j in offloaded if j < block]
    if below:
        total += moved[below[-1]](b)
    return max(total, 0.0)
