"""The verifier: run one configuration for real on the device, under the budget.

It measures the peak by the device's definition and the throughput over whole optimizer
steps. An out-of-memory error (real on CUDA, the budget guard's on CPU) is caught and
becomes the reason the configuration was rejected.

The evaluation batch of each verified config (:func:`with_eval_batches`): the largest
no-grad forward that fits the budget beside its training state (a trainer's evaluation
loop runs between its steps, with its own batch size, on the device the training state
fills).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autotune._format import format_bytes
from autotune.config import TrainConfig, is_factory
from autotune.device import backend_for
from autotune.errors import NonFiniteError, warn
from autotune.measure import measure_peak, state_tensors
from autotune.result import Measurement, TrialRecord
from autotune.train import (
    LossFn,
    Runner,
    Workload,
    agree_max,
    any_batch_size,
    batch_size,
    collective,
    compute_loss,
    copy_model,
    map_tensors,
    prepare,
    raised_in,
    resize,
    snapshot,
    split,
    step_batch,
    tensors_on,
)

__all__ = ["Verifier", "with_eval_batches"]


def _evaluate(runner: Runner, batch: Any) -> None:
    """An evaluation forward with the model's own loss (a trainer evaluates through the
    model's forward, which makes the logits the chunked loss spares training); where the
    model's output in eval mode holds no loss to read (a detection model's detections), the
    forward alone, whose output was alive when the loss was asked for."""
    try:
        runner.forward_loss(batch, evaluating=True)
    except Exception as exc:
        if isinstance(exc, torch.OutOfMemoryError) or not raised_in(exc, compute_loss):
            raise


log = logging.getLogger("autotune")

_TIMED_S = 3.0
"""Stop timing a configuration once its timed steps add up to this many seconds."""
_MIN_TIMED_S = 1.0
_MAX_TIMED_STEPS = 20
_LOST_BY = 0.15
"""A config whose fastest timed step is this much slower than the best speed so far has
lost: twice the lead (7%) that re-timing races after one timing each."""


class Verifier:
    """Runs configurations on ``model`` (the tuner's copy) and measures them.

    Args:
        model: The tuner's copy of the model, on ``device``.
        sample: The user's sample batch (resized to each configuration's batch).
        device: The target device.
        budget_bytes: The device-memory budget; exceeding it rejects a configuration.
        loss_fn: The user's loss function, or ``None``.
        context_bytes: CUDA context size (0 on CPU).
        foreign_bytes: CUDA bytes held by other tensors when tuning began.
        steps: Timed optimizer steps per configuration (median reported).
        blocks: The blocks (FSDP's units).
        written: The buffers a training step writes: each step copies them first, as a
            runner with fallbacks does, so that the copy is in the peak measured.

    A data-parallel configuration runs on a copy of ``model`` wrapped as it says, on every
    rank of the process group at once; every rank gets the slowest rank's time and the
    largest peak, so that all decide alike.
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        *,
        device: torch.device,
        budget_bytes: int,
        loss_fn: LossFn | None,
        context_bytes: int = 0,
        foreign_bytes: int = 0,
        steps: int = 3,
        blocks: tuple[str, ...] = (),
        written: tuple[str, ...] = (),
    ) -> None:
        self.model = model
        self.blocks = blocks
        self.written = written
        self.sample = sample
        self.device = device
        self.budget_bytes = budget_bytes
        self.loss_fn = loss_fn
        self.context_bytes = context_bytes
        self.foreign_bytes = foreign_bytes
        self.steps = steps
        self.backend = backend_for(device)

    @staticmethod
    def of(
        work: Workload, budget_bytes: int, context_bytes: int = 0, written: tuple[str, ...] = ()
    ) -> Verifier:
        """The verifier of ``work`` under ``budget_bytes`` (a CUDA context of
        ``context_bytes`` counted in each peak; the buffers a step ``written`` copied
        before each step)."""
        return Verifier(
            work.model,
            work.sample,
            device=work.device,
            budget_bytes=budget_bytes,
            loss_fn=work.loss_fn,
            context_bytes=context_bytes,
            foreign_bytes=work.foreign_bytes,
            blocks=work.blocks,
            written=written,
        )

    def trial(
        self, config: TrainConfig, *, timed: bool = True, beat: float = 0.0
    ) -> tuple[Measurement | None, str | None]:
        """Measure ``config``: (measurement, None), or (None, why it was rejected).

        The peak is measured over steps of two micro-batches (the peak of any
        accumulation: every later micro-batch holds what the second held) with the whole
        batch held, as a step of it holds it (see :meth:`_measure`). ``timed=False``: the
        peak alone (a fallback's, kept for its memory); the measurement's speed is then 0
        (not measured).

        ``beat``: the best speed measured so far (samples/s; 0: none). A config whose
        fastest of two or more timed steps is :data:`_LOST_BY` slower than it has lost (a
        lead no re-timing races) and stops being timed: its speed is the median of the
        steps timed.
        """
        n = config.effective_batch_size
        batch = step_batch(self.sample, n, config.micro_batch_size)
        if n < batch_size(self.sample):  # views: they would hold the whole sample
            batch = map_tensors(batch, torch.clone)  # a loader's batch holds n rows
        runner: Runner | None = None
        error: str | None = None
        peak, step_s = 0, None
        self._release(before=True)  # no cached blocks of earlier runs in this config's peak
        try:
            with self._together(config):
                runner = self._prepare(config)
                lost_s = config.global_batch_size / beat * (1 + _LOST_BY) if beat > 0 else None
                peak, step_s = self._measure(runner, batch, timed=timed, lost_s=lost_s)
                runner.check_steps()  # a step the device refused (fp16 overflowing, say)
        except torch.OutOfMemoryError as exc:
            error = f"out of memory: {str(exc).splitlines()[0] if str(exc) else 'OOM'}"
        except NonFiniteError as exc:  # e.g. fp16 overflowing in this model's forward
            error = f"not finite: {str(exc).split(':')[0]}"
        finally:
            if runner is not None:
                runner.close()  # gradients on both sides, offload hooks and pinned memory
            del runner
            self._release()
        if config.parallel != "none":  # every rank decides on the same numbers (each timed
            # step took the slowest rank's time already)
            peak_f, failed = agree_max([peak, error is not None], self.device)
            peak = int(peak_f)
            error = error or ("out of memory on another rank" if failed else None)
        if error is not None:
            return None, error
        if peak > self.budget_bytes:
            return None, (
                f"measured peak {format_bytes(peak)} exceeds the budget of "
                f"{format_bytes(self.budget_bytes)}"
            )
        if step_s is None:  # a peak alone
            return Measurement(peak, 0.0, 0.0), None
        return Measurement(peak, step_s, config.global_batch_size / step_s), None

    @staticmethod
    def _together(config: TrainConfig) -> contextlib.AbstractContextManager[None]:
        """A data-parallel run's collectives failing means another rank is gone: say so."""
        if config.parallel == "none":
            return contextlib.nullcontext()
        return collective(f"verifying {config.describe()} with the other ranks")

    def _prepare(self, config: TrainConfig) -> Runner:
        # Data parallelism wraps the model for good: a copy of it, each time.
        model = self.model if config.parallel == "none" else copy_model(self.model)
        lr = None if is_factory(config.optimizer) else 1e-6  # a factory sets its own
        return prepare(
            model, config, lr=lr, loss_fn=self.loss_fn, device=self.device, blocks=self.blocks
        )

    def _measure(
        self, runner: Runner, batch: Any, *, timed: bool, lost_s: float | None = None
    ) -> tuple[int, float | None]:
        """The peak of ``runner``'s steps on ``batch`` and (``timed``) their median seconds,
        timed until two or more steps say it is slower than ``lost_s`` a step, where given.

        The peak is that of a step on the first two micro-batches of ``batch`` with all of
        it held, after a step on one micro-batch that makes the optimizer's state: every
        later micro-batch of an accumulation holds what the second held, so this is the
        whole step's peak, at a fraction of its cost where a step accumulates many. On a
        device whose allocator caches (CUDA), the peak is read over the warm-up and the
        timed steps themselves, at no cost: a timed config's steps are whole there.
        """
        budget = self.budget_bytes
        mb = runner.config.micro_batch_size
        part = split(batch, 2 * mb)[0]  # views of the batch: it stays held whole
        if self.backend.caching:
            with measure_peak(
                self.device,
                budget_bytes=budget,
                context_bytes=self.context_bytes,
                foreign_bytes=self.foreign_bytes,
            ) as reading:
                seconds = None
                if timed:
                    self._step(runner, batch)  # warm-up: allocates optimizer state
                    seconds = statistics.median(self._timed_steps(runner, batch, lost_s))
                else:
                    self._step(runner, split(part, mb)[0])
                    self._step(runner, part)
                _next_batch(batch)
            return reading.peak_bytes, seconds
        # CPU: the first step makes the optimizer's state, the second is measured at
        # steady state (holding that state and all the first held); the timed steps run
        # without the tracker's overhead. The batch counts: training holds it through the
        # step (on CUDA it is in the reserved bytes already where it lives on the device).
        held = tensors_on(batch, self.device)
        compiled = runner.config.compile_level != "none"
        # Untracked where eager (the tracker slows each op): a config over the budget is
        # refused by the next step's guard. Compiled, it compiles under the tracker it runs
        # in (see tracker_for).
        with (
            measure_peak(
                self.device,
                existing=[*self._state(runner), *held],
                budget_bytes=budget,
                compiled=compiled,
            )
            if compiled
            else contextlib.nullcontext()
        ):
            self._step(runner, split(part, mb)[0])
        peak = 0
        # DDP builds its buckets again in its second step, steady from its third: both count.
        for _ in range(2 if runner.config.parallel == "ddp" else 1):
            with measure_peak(
                self.device,
                existing=[*self._state(runner), *held],
                budget_bytes=budget,
                gathering=[runner.model],
                compiled=compiled,
            ) as reading:
                self._step(runner, part)
                _next_batch(batch)
            peak = max(peak, reading.peak_bytes)
        seconds = statistics.median(self._timed_steps(runner, batch, lost_s)) if timed else None
        return peak, seconds

    def _step(self, runner: Runner, batch: Any) -> None:
        """One training step, as a runner with fallbacks takes it: the buffers the step
        writes copied first (to put back after an out-of-memory error), held through it."""
        kept = snapshot(runner.model, runner.backend, self.written) if self.written else None
        runner.step(batch)
        del kept

    def _timed_steps(self, runner: Runner, batch: Any, lost_s: float | None = None) -> list[float]:
        """Timed steps: at least ``steps`` and 1 s of them (a window a hiccup cannot own),
        at most 20 steps or 3 s (one step when a step alone is that long), or two where
        both took more than ``lost_s``. With data parallelism each step's time is the
        slowest rank's, so that every rank takes as many steps (a rank stepping alone
        would wait for the others forever)."""

        def timed() -> float:
            seconds = self._timed(lambda: self._step(runner, batch))
            if runner.config.parallel == "none":
                return seconds
            return agree_max([seconds], self.device)[0]

        times = [timed()]
        while (
            (lost_s is None or len(times) < 2 or min(times) <= lost_s)
            and sum(times) < _TIMED_S
            and len(times) < _MAX_TIMED_STEPS
            and (len(times) < self.steps or sum(times) < _MIN_TIMED_S)
        ):
            times.append(timed())
        return times

    def eval_batch(self, config: TrainConfig, wanted: int | None, most: int) -> int | None:
        """The largest evaluation batch (a no-grad forward with its loss where it has one,
        in eval mode, in the config's precision) that fits the budget after a training
        step of ``config``, up to ``most``; ``wanted``: that size, where it fits.
        Measured: at ``most`` (or ``wanted``) first; where that does not fit, at the
        micro-batch and twice it, the line through them says the largest, which is run
        (and lowered until it fits). ``None``: not even the micro-batch fits."""
        self._release(before=True)
        runner = self._prepare(config)
        try:
            # One micro-batch's step makes the optimizer's state, as a whole step would.
            runner.step(resize(self.sample, config.micro_batch_size))
            measure = functools.partial(self._eval_peak, runner)
            small, budget = config.micro_batch_size, self.budget_bytes
            return _largest_fitting(measure, small, wanted, most, budget)
        finally:
            runner.close()
            del runner
            self._release()

    def _eval_peak(self, runner: Runner, n: int) -> int | None:
        """The peak of one evaluation forward of ``n`` samples beside the training state
        (``None``: over the budget)."""
        batch = resize(self.sample, n)
        batch = map_tensors(batch, torch.clone)  # a loader's batch holds n rows
        held = [] if self.backend.caching else tensors_on(batch, self.device)
        model = runner.model
        was_training = model.training
        model.eval()
        self._release(before=True)
        try:
            with (
                measure_peak(
                    self.device,
                    existing=[*self._state(runner), *held],
                    budget_bytes=self.budget_bytes,
                    context_bytes=self.context_bytes,
                    foreign_bytes=self.foreign_bytes,
                    compiled=runner.config.compile_level != "none",
                ) as reading,
                torch.no_grad(),
                any_batch_size(),  # a model compiled whole: one graph for every size tried
            ):
                _evaluate(runner, batch)
        except torch.OutOfMemoryError:
            return None
        finally:
            model.train(was_training)
        return reading.peak_bytes if reading.peak_bytes <= self.budget_bytes else None

    def retime(self, config: TrainConfig) -> float:
        """Seconds per step of ``config`` again, without measuring its peak (it fitted).

        The first of its timed steps is also its warm-up (the optimizer's state made, the
        allocator's blocks taken): the median of three or more steps leaves one slow step
        out, where a warm-up step of its own would cost a step more per timing.
        """
        batch = step_batch(self.sample, config.effective_batch_size, config.micro_batch_size)
        self._release(before=True)
        runner = self._prepare(config)
        try:
            with self._together(config):
                return statistics.median(self._timed_steps(runner, batch))
        finally:
            runner.close()
            del runner
            self._release()

    def record(
        self, config: TrainConfig, predicted: Measurement, *, timed: bool = True, beat: float = 0.0
    ) -> TrialRecord:
        """Run ``config`` and wrap the outcome as a :class:`TrialRecord` (``timed`` and
        ``beat``: as :meth:`trial`; not timed, its record is ``peak_only``)."""
        measured, error = self.trial(config, timed=timed, beat=beat)
        return TrialRecord(config, predicted, measured, error, peak_only=not timed)

    @staticmethod
    def _state(runner: Runner) -> list[torch.Tensor]:
        state = state_tensors(runner.model, runner.optimizer, runner.scaler)
        if runner.host is not None:  # master weights: counted where the host is the device
            state += runner.host.pinned_tensors()
        return state

    def _timed(self, fn: Callable[[], Any]) -> float:
        self._sync()
        start = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - start

    def _sync(self) -> None:
        self.backend.synchronize()

    def _release(self, *, before: bool = False) -> None:
        """Free what earlier runs left: after a run, always (its cycles hold tensors);
        ``before`` one, only where the device caches freed blocks (CUDA: they would count
        in the reserved peak). The CPU's peak counts the run's own tensors only, and a full
        collection there costs a tenth of a second in a process holding transformers."""
        if before and not self.backend.caching:
            return
        gc.collect()
        self.backend.empty_cache()
        self.backend.empty_host_cache()  # pinned buffers of an offloading config, between configs


def _next_batch(batch: Any) -> None:
    """Make a batch like ``batch`` beside it and free it: a training loop's loader makes
    the next step's batch while the last one is still held (``for batch in loader``)."""
    made = map_tensors(batch, torch.clone)
    del made


def _largest_fitting(
    peak: Callable[[int], int | None], small: int, wanted: int | None, most: int, budget: int
) -> int | None:
    """The largest size ``n`` up to ``most`` whose ``peak(n)`` fits (is not ``None``):
    ``wanted`` (else ``most``) where it fits, else from the line through ``small`` and
    twice it. Tried first, the size wanted costs one forward where it fits (most often),
    and little where it does not: the budget guard stops it as it passes the budget."""
    first = wanted if wanted is not None else most
    if peak(first) is not None:
        return first
    most = min(most, first - 1)
    at_small = peak(small) if small <= most else None
    if at_small is None:
        return None
    second = peak(2 * small) if 2 * small <= most else None
    if second is None:
        return small
    slope = max((second - at_small) / small, 1.0)
    n = min(most, 2 * small + int((budget - second) / slope))
    while n > 2 * small and peak(n) is None:
        n = max(2 * small, int(n * 0.9))
    return n


_BEYOND = 4
"""The evaluation batch is looked for up to this many times the micro-batch (and at least
up to 8, the Hugging Face Trainer's default): beyond, an evaluation gains little speed and
the search would run forwards larger than any training step."""


def with_eval_batches(
    verifier: Verifier, configs: Sequence[TrainConfig], wanted: int | None, most: int
) -> list[TrainConfig]:
    """``configs`` with their evaluation batch sizes, the largest that fits up to
    :data:`_BEYOND` times the micro-batch (and ``most``), measured once per precision,
    optimizer, placement and attention (what an evaluation holds: the parameters, the
    optimizer's state and one forward; not the checkpoint mask). ``wanted``: the user's
    size, kept where it fits (a warning says where it does not)."""
    sizes: dict[tuple[object, ...], int | None] = {}
    out = []
    for c in configs:
        if c.parallel != "none":  # each rank evaluates its own shard of the batch: not run
            out.append(c)
            continue
        key = (c.timeline, c.optimizer, c.offload_optimizer, c.attention)
        if key not in sizes:
            bound = min(most, max(8, _BEYOND * c.micro_batch_size))
            sizes[key] = size = verifier.eval_batch(c, wanted, bound)
            log.info("evaluation batch beside %s: %s", c.describe(), size)
            if wanted is not None and size != wanted:
                warn(
                    f"an evaluation batch of {wanted} does not fit the budget beside the "
                    f"training state of {c.describe()}; the largest that does is {size or 0}. "
                    "Evaluate with that (the exports set it), or raise the budget.",
                )
        out.append(c.replace(eval_batch_size=sizes[key]))
    return out
