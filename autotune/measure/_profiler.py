"""The profiler: single measurements of a model on the target device.

Per precision: a phase-labelled memory timeline (see :mod:`autotune.measure._timeline`)
at two micro-batch sizes, kept, checkpointed, offloaded and checkpointed selectively, and
forward+backward times.
Per optimizer: state bytes, the step's transient peak and its time, on the device and on
the host. Everything runs on a copy of the user's model that the caller owns; the
routines that assemble a :class:`~autotune._profile_data.Profile` from these are
in ``_memory_profile`` and ``_time_profile``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autotune._profile_data import (
    CHECKPOINT,
    KEEP,
    OFFLOAD,
    SELECTIVE,
    Line,
    OptimizerProfile,
    Phase,
    PrecisionProfile,
    Requests,
    StepRequests,
)
from autotune._spelling import option
from autotune.config import (
    Timeline,
    TrainConfig,
    is_factory,
)
from autotune.device import AllocatorSettings, RequestLog, backend_for
from autotune.errors import AutotuneError, BatchError, LossError, ProfileError
from autotune.measure._crossings import crossings
from autotune.measure._fake import simulated_now
from autotune.measure._peak import measure_peak
from autotune.measure._timeline import Lives, fit_phases, tracked_step
from autotune.measure._tracker import LiveBytesTracker, PhaseRecord, state_tensors
from autotune.train import (
    LossFn,
    Runner,
    Workload,
    apply_checkpointing,
    apply_offloading,
    batch_size,
    call_model,
    compute_loss,
    describe_call,
    prepare,
    raised_in,
    remove_checkpointing,
    resize,
)

__all__ = ["Profiler"]

_PROFILE_LR = 1e-6  # the copy trains while it is measured; keep its weights sane
_SHORT_PASS_S = 0.2
"""A timed pass shorter than this is timed in several rounds (its median kept): a slow
spell of a few hundredths of a second would own a single one."""


class Profiler:
    """Runs the measurements on ``model`` (a copy the tuner owns, on the target device).

    Args:
        model: The model to measure; it is trained a little, at a tiny learning rate.
        sample: The user's sample batch.
        blocks: Qualified names of the blocks.
        device: The target device.
        loss_fn: The user's loss function, or ``None``.
        foreign_bytes: CUDA bytes held by other tensors of the process (not the model's).
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        blocks: Sequence[str],
        *,
        device: torch.device,
        loss_fn: LossFn | None,
        foreign_bytes: int = 0,
    ) -> None:
        self.model = model
        self.sample = sample
        self.blocks = tuple(blocks)
        self.modules = [model.get_submodule(n) for n in self.blocks]
        self.device = device
        self.loss_fn = loss_fn
        self.foreign_bytes = foreign_bytes
        self.backend = backend_for(device)
        self.repeats = 1 if simulated_now() is not None else 3  # a roofline does not vary

    @staticmethod
    def of(work: Workload) -> Profiler:
        """The profiler of ``work``."""
        return Profiler(
            work.model,
            work.sample,
            work.blocks,
            device=work.device,
            loss_fn=work.loss_fn,
            foreign_bytes=work.foreign_bytes,
        )

    def over(self, model: nn.Module) -> Profiler:
        """A profiler of the same sample, blocks, device and loss over ``model``, a copy."""
        return Profiler(
            model,
            self.sample,
            self.blocks,
            device=self.device,
            loss_fn=self.loss_fn,
            foreign_bytes=self.foreign_bytes,
        )

    def config(self, timeline: Timeline, b: int, **knobs: Any) -> TrainConfig:
        """The config of ``timeline`` at micro-batch ``b``."""
        return TrainConfig(micro_batch_size=b, **timeline.knobs(self.blocks), **knobs)

    def runner(self, config: TrainConfig) -> Runner:
        lr = None if is_factory(config.optimizer) else _PROFILE_LR  # a factory sets its own
        return prepare(self.model, config, lr=lr, loss_fn=self.loss_fn, device=self.device)

    def first_step(self, config: TrainConfig, b: int) -> Runner:
        """Build a runner and take one step; user-model failures become ProfileError."""
        runner = self.runner(config)
        try:
            batch = resize(self.sample, b)
            with _model_errors(self.model, batch, self.loss_fn):
                runner.step(batch)
            runner.check_steps()  # a loss not finite on the sample: said now
        except BaseException:
            runner.close()
            raise
        return runner

    def optimizer(self, name: str, b: int) -> OptimizerProfile:
        """State bytes, step transient and step time of optimizer ``name``; on a caching
        device, its step's requests too, recorded first (the step the allocator's model
        replays where ``name`` is not the optimizer the timelines were tracked with)."""
        runner = self.first_step(TrainConfig(micro_batch_size=b, optimizer=name), b)
        with runner:
            chunk = resize(self.sample, b)
            requests = self._step_requests(runner, chunk) if self.backend.caching else None
            state = sum(t.untyped_storage().nbytes() for t in state_tensors(runner.optimizer))
            runner.forward_backward(chunk)
            tracker = LiveBytesTracker(self.device.type)
            existing = state_tensors(runner.model, runner.optimizer)
            with measure_peak(self.device, existing=existing, tracker=tracker):
                start = tracker.live
                runner.optimizer_step()
            times = []
            for _ in range(self.repeats):
                runner.forward_backward(chunk)
                times.append(self._timed(runner.optimizer_step))
        # The step's transient in live bytes, as the cost model adds it to live bytes (the
        # reserved peak would count weights, gradients, state and cached blocks too).
        transient = tracker.peak - start
        seconds = statistics.median(times)
        return OptimizerProfile(name, state, transient, seconds, requests=requests)

    def _step_requests(self, runner: Runner, chunk: Any) -> StepRequests | None:
        """The caching allocator's requests in ``runner``'s optimizer step, and the
        segments a step begins with (nothing cached); ``None`` where not recorded."""
        self.backend.empty_cache()
        with self.backend.requests() as requested:
            runner.forward_backward(chunk)
            requested.cut()
            runner.optimizer_step()
        log = requested.log
        if log is None or len(log.cuts) != 1:
            return None
        step = log.order[log.cuts[0] :]
        made = {i: k for k, i in enumerate(i for i in step if i >= 0)}
        return StepRequests(
            start=tuple(log.start),
            sizes=tuple(log.allocations[i][0] for i in made),
            streams=tuple(log.allocations[i][1] for i in made),
            order=tuple(
                made[i] if i >= 0 else -1 - made[-1 - i]
                for i in step
                if (i if i >= 0 else -1 - i) in made  # the gradients' frees: not the step's
            ),
        )

    def host_step(self, name: str, b: int) -> float:
        """Median seconds of optimizer ``name``'s step on the host (offloaded), no transfers."""
        runner = self.first_step(
            TrainConfig(micro_batch_size=b, optimizer=name, offload_optimizer=True), b
        )
        with runner:
            assert runner.host is not None
            chunk = resize(self.sample, b)
            times = []
            for _ in range(self.repeats):
                runner.forward_backward(chunk)
                runner.host.gather()
                start = time.perf_counter()
                runner.host.host_step(runner.apply_step)
                times.append(time.perf_counter() - start)
                runner.host.upload()
                runner.zero_grad()
        return statistics.median(times)

    def memory(
        self,
        timeline: Timeline,
        optimizer: str,
        b1: int,
        b2: int,
        *,
        offload: bool = False,
        selective: bool = False,
    ) -> PrecisionProfile:
        """The phase timeline of ``timeline`` at micro-batch sizes ``b1`` < ``b2``.

        Variants: every block kept, every block checkpointed, (``offload``) every block
        offloaded, with the bytes each block sends to the host, and (``selective``) every
        block checkpointed selectively; compiled blocks, or the model compiled whole, only
        kept and checkpointed. A variant not run takes the kept run's lines.
        """
        compiled = timeline.compiled
        whole = timeline.level == "model"
        at: tuple[int, ...] = (b1, b2)
        if compiled:
            offload = selective = False
        if compiled and not whole:  # its peaks bend at small sizes: a third size (Phase.floor)
            at = (b1, b2, 2 * b2)
        runner = self.first_step(self.config(timeline, b1, optimizer=optimizer), b1)
        variants = [KEEP, CHECKPOINT] if self.blocks else [KEEP]
        if self.blocks and offload:
            variants.append(OFFLOAD)
        if self.blocks and selective:
            variants.append(SELECTIVE)
        with runner:
            state = sum(t.untyped_storage().nbytes() for t in state_tensors(runner.optimizer))
            tracked = self._tracked(runner, variants, at, compiled=compiled, whole=whole)
        runs, moved, copies, beyond = tracked.runs, tracked.moved, tracked.copies, tracked.beyond
        # Every index up to the last variant run; one not run reads as the kept run.
        indices = range(max(variants) + 1)
        fitted = [[runs.get((b, v), runs[b, KEEP]) for v in indices] for b in at]
        third = (at[2], fitted[2]) if len(at) > 2 else (None, [])
        base, phases = fit_phases(b1, fitted[0], b2, fitted[1], *third)
        # The tracked step ends with one optimizer's step; the cost model adds each one's own.
        micro = tuple(p for p in phases if p.key.micro in (1, 2))
        lines: tuple[Line, ...] = ()
        sizes: tuple[tuple[Line, ...], ...] = ()
        if OFFLOAD in variants:
            lines = tuple(
                Line.through(b1, m1, b2, m2) for m1, m2 in zip(moved[b1], moved[b2], strict=True)
            )
            sizes = tuple(
                _copy_lines(b1, c1, b2, c2, total)
                for c1, c2, total in zip(copies[b1], copies[b2], lines, strict=True)
            )
            micro = tuple(_own_backward(ph, lines) for ph in micro)
        # What the allocator reserves beyond the live bytes: rounding and segments (a
        # constant) and fragmentation that grows with the activations (the slope).
        reserve = tuple(Line.rising(beyond.get(v, beyond[KEEP])) for v in indices if beyond)
        requests = _requests(tracked.requests, b1, b2, indices, self.foreign_bytes)
        return PrecisionProfile(
            timeline,
            base - state,
            micro,
            reserve=reserve,
            moved=lines,
            copies=sizes,
            selective=SELECTIVE in variants,
            requests=requests,
            crossings=crossings(runs, tracked.lives, (b1, b2), variants),
        )

    def _tracked(
        self,
        runner: Runner,
        variants: Sequence[int],
        at: Sequence[int],
        *,
        compiled: bool,
        whole: bool,
    ) -> _Tracked:
        """The tracked steps of each variant at each size of ``at``, on ``runner``. A model
        compiled ``whole`` is one graph: its step is tracked without a phase per block (a
        hook inside the graph would be compiled into it)."""
        out = _Tracked()
        modules = () if whole else self.modules
        for variant in variants:
            self._every(variant, plain=whole)
            if variant == OFFLOAD:
                apply_offloading(self.model, self.blocks, runner.offloader)
            if whole:  # a graph per size (shapes static), each compiled before tracked
                for b in at:
                    runner.forward_backward(resize(self.sample, b))
                runner.zero_grad()
            elif compiled:  # compiled at each size and beneath its wrapper before tracked
                for b in at:
                    runner.step(resize(self.sample, b))
            for b in at:
                if self.backend.caching:  # start from no cached blocks, as verify does
                    self.backend.empty_cache()
                lives = None if compiled or whole else Lives()
                with self.backend.requests() as requested:
                    out.runs[b, variant] = records = tracked_step(
                        runner, resize(self.sample, b), modules, requested.cut, lives
                    )
                if lives is not None:
                    out.lives[b, variant] = lives
                if requested.log is not None:
                    out.requests[b, variant] = (requested.log, records[0].entry)
                if variant == OFFLOAD:
                    out.moved[b] = [runner.offloader.moved_bytes.get(n, 0) for n in self.blocks]
                    out.copies[b] = [runner.offloader.copies.get(n, []) for n in self.blocks]
                if self.backend.caching:
                    # Same step, two views: live tensor bytes and what the allocator reserved.
                    reserved = self.backend.max_reserved() - self.foreign_bytes
                    live = max(r.peak for r in records)
                    out.beyond.setdefault(variant, []).append((b, float(reserved - live)))
        return out

    def fwd_bwd_time(self, timeline: Timeline, b: int, *, every: int = KEEP) -> float:
        """Median seconds of one micro-batch's forward+backward at size ``b``, with every
        block kept, checkpointed (``every=CHECKPOINT``) or checkpointed selectively."""
        return self.fwd_bwd_times(timeline, b, (every,))[every]

    def fwd_bwd_times(
        self, timeline: Timeline, b: int, variants: Sequence[int]
    ) -> dict[int, float]:
        """:meth:`fwd_bwd_time` of each of ``variants`` (KEEP, CHECKPOINT, SELECTIVE), on
        one runner after one warm-up pass, the variants timed in turn (several rounds where
        the first round's pass was shorter than :data:`_SHORT_PASS_S`), so that a slow spell
        hits them alike. The warm-up does not decide the rounds: the process's first pass,
        or a precision's first at a shape, pays one-time costs (lazy initialisation, the
        kernels' primitives made) several times a pass."""
        runner = self.runner(self.config(timeline, b))
        chunk = resize(self.sample, b)
        times: dict[int, list[float]] = {v: [] for v in variants}
        plain = runner.config.compile_model
        try:
            if runner.config.compile_level != "none":  # compiled, beneath each wrapper, untimed
                for v in variants:
                    self._every(v, plain=plain)
                    with _model_errors(self.model, chunk, self.loss_fn):
                        runner.forward_backward(chunk)
            self._every(variants[0], plain=plain)
            with _model_errors(self.model, chunk, self.loss_fn):
                runner.forward_backward(chunk)  # warm-up: the allocator's and kernels' first use
            for _ in range(self.repeats):
                for v in variants:
                    self._every(v, plain=plain)
                    times[v].append(self._timed(lambda: runner.forward_backward(chunk)))
                if times[variants[0]][0] >= _SHORT_PASS_S:  # a long pass is its own average
                    break
        finally:
            runner.close()  # the checkpoint wrappers and the gradients
        return {v: statistics.median(ts) for v, ts in times.items()}

    def _every(self, variant: int, *, plain: bool = False) -> None:
        """Every block kept, checkpointed or checkpointed selectively (``plain``: by a
        checkpoint the graph of a model compiled whole holds)."""
        remove_checkpointing(self.model)
        if variant in (CHECKPOINT, SELECTIVE):
            selective = variant == SELECTIVE
            apply_checkpointing(self.model, self.blocks, selective=selective, plain=plain)

    def block_weights(self, timeline: Timeline, b: int) -> tuple[float, ...]:
        """Each block's share of the blocks' forward time, from one timed forward."""
        spent, _ = self.block_times(timeline, b)
        total = sum(spent)
        if total <= 0 or not self.modules:
            return tuple(1.0 / max(len(self.modules), 1) for _ in self.modules)
        return tuple(s / total for s in spent)

    def block_times(self, timeline: Timeline, b: int) -> tuple[tuple[float, ...], float]:
        """(each block's seconds, the whole forward's seconds) of one timed forward."""
        runner = self.runner(self.config(timeline, b))
        starts: dict[int, float] = {}
        spent = [0.0] * len(self.modules)
        handles = []
        for i, module in enumerate(self.modules):
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, i=i: starts.__setitem__(i, self._now())
                )
            )
            handles.append(
                module.register_forward_hook(
                    lambda m, a, o, i=i: spent.__setitem__(i, spent[i] + self._now() - starts[i])
                )
            )
        try:
            with torch.no_grad():
                whole = self._timed(lambda: runner.forward_loss(resize(self.sample, b)))
        finally:
            for h in handles:
                h.remove()
            runner.close()
        return tuple(spent), whole

    def _now(self) -> float:
        """Seconds on the device's clock: measured, or a roofline's where one is active
        (a traced model planned for a device not here)."""
        simulated = simulated_now()
        if simulated is not None:
            return simulated
        self.backend.synchronize()
        return time.perf_counter()

    def _timed(self, fn: Callable[[], Any]) -> float:
        start = self._now()
        fn()
        return self._now() - start


@contextlib.contextmanager
def _model_errors(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> Iterator[None]:
    """A failure of the user's model (not ours, not out of memory) as an AutotuneError: a
    forward that rejects the sample batch is a BatchError that says how it was called, a
    ``loss_fn`` that fails a LossError, anything else a ProfileError."""
    try:
        yield
    except (AutotuneError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        b = batch_size(batch)
        cut = f"cut to {b} sample{'s' if b != 1 else ''}"
        failed = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        if raised_in(exc, call_model):
            call = describe_call(model, batch, has_loss_fn=loss_fn is not None)
            raise BatchError(
                f"the model's forward failed on the sample batch ({cut}): {call}, and it "
                f"raised {failed}. Pass a sample batch as the training loop will, one the "
                "model's forward takes: a tensor is fed as model(batch), a dict as "
                "model(**batch) (with a loss_fn, its keys that are arguments of forward), "
                "a tuple or list as model(*batch) (with a loss_fn, model(*batch[:-1]): "
                "the last item is the target the loss_fn reads)."
            ) from exc
        if loss_fn is not None and raised_in(exc, compute_loss):
            raise LossError(
                f"{option('loss_fn')}(output, batch) failed on the sample batch ({cut}) "
                f"with {failed}. It gets the model's output and the whole batch, and must "
                "return a scalar tensor."
            ) from exc
        raise ProfileError(
            f"training the model on the sample batch cut to {b} samples failed with {failed}."
        ) from exc


def _copy_lines(
    b1: int, sizes1: Sequence[int], b2: int, sizes2: Sequence[int], total: Line
) -> tuple[Line, ...]:
    """Each host copy's bytes against the micro-batch size, matched in the order the block
    saved them (the whole block as one copy where the two sizes saved different tensors)."""
    if len(sizes1) != len(sizes2):
        return (total,)
    return tuple(Line.through(b1, s1, b2, s2) for s1, s2 in zip(sizes1, sizes2, strict=True))


def _own_backward(phase: Phase, moved: Sequence[Line]) -> Phase:
    """The offloaded variant of a block's backward without the restores it triggered.

    With every block offloaded, block k's backward begins by restoring the block below it
    (the prefetch; for the top block also itself). The cost model adds the restores the
    actual choice of offloaded blocks triggers, so they are taken out of the measurement.
    """
    if phase.block is None or phase.key.label != "bwd":
        return phase
    k = phase.block
    extra = Line(0.0, 0.0)
    if k >= 1:
        extra = extra + moved[k - 1]
    if k == len(moved) - 1:
        extra = extra + moved[k]

    def own(lines: tuple[Line, ...]) -> tuple[Line, ...]:
        return tuple(line - extra if v == OFFLOAD else line for v, line in enumerate(lines))

    bends = tuple(
        tuple(line - extra for line in lines) if v == OFFLOAD else lines
        for v, lines in enumerate(phase.bends)
    )
    return dataclasses.replace(phase, delta=own(phase.delta), peak=own(phase.peak), bends=bends)


def _requests(
    logs: dict[tuple[int, int], tuple[RequestLog, int]],
    b1: int,
    b2: int,
    variants: Sequence[int],
    foreign: int,
) -> tuple[Requests | None, ...]:
    """Each variant's requests against the micro-batch size (empty: none recorded)."""
    out = tuple(_variant_requests(logs, b1, b2, v, foreign) for v in variants)
    return out if any(out) else ()


def _variant_requests(
    logs: dict[tuple[int, int], tuple[RequestLog, int]], b1: int, b2: int, v: int, foreign: int
) -> Requests | None:
    """A variant's requests against the micro-batch size, from its steps at ``b1`` and
    ``b2`` (``None`` where not recorded, or where the two steps asked differently)."""
    if (b1, v) not in logs or (b2, v) not in logs:
        return None
    (one, _), (two, held) = logs[b1, v], logs[b2, v]
    settings = two.settings  # in force as it ran: however they were set
    if not AllocatorSettings.parse(settings).native:  # cudaMallocAsync: not modelled
        return None
    streams = [s for _, s in two.allocations]
    if one.order != two.order or one.cuts != two.cuts or [s for _, s in one.allocations] != streams:
        return None  # the two sizes asked differently: no request is one line
    return Requests(
        settings=settings,
        start=tuple(two.start),
        sizes=tuple(
            Line.through(b1, n1, b2, n2)
            for (n1, _), (n2, _) in zip(one.allocations, two.allocations, strict=True)
        ),
        streams=tuple(streams),
        order=tuple(two.order),
        held=held,
        foreign=foreign,
        cuts=tuple(two.cuts),
    )


@dataclasses.dataclass
class _Tracked:
    """One precision's tracked steps: the phase records of each (size, variant); per
    size, the bytes each block sent to the host and its copies (offloaded); per variant,
    what the allocator reserved beyond the live bytes at each size (a caching device)."""

    runs: dict[tuple[int, int], list[PhaseRecord]] = dataclasses.field(default_factory=dict)
    moved: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    copies: dict[int, list[list[int]]] = dataclasses.field(default_factory=dict)
    beyond: dict[int, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    requests: dict[tuple[int, int], tuple[RequestLog, int]] = dataclasses.field(
        default_factory=dict
    )
    """The allocator's requests in each (size, variant)'s step, and the live bytes it
    began with (a caching device where they can be recorded)."""
    lives: dict[tuple[int, int], Lives] = dataclasses.field(default_factory=dict)
    """Where each (size, variant)'s storages were made and freed (eager runs)."""
