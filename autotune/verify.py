"""Verification: run candidate configurations for real on the device, under the budget.

Measured peak and throughput decide. An out-of-memory error (real on CUDA, the budget
guard's on CPU) is caught, recorded, and the next candidate is tried. The fallback ladder
is verified the same way.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import batch as batching
from .config import Measurement, TrainConfig, TrialRecord
from .cost import CostModel
from .errors import VerificationError
from .loss import LossFn
from .memory import measure_peak, state_tensors
from .runtime import Runner, prepare
from .search import Candidate, Study, best_config
from .target import format_bytes

__all__ = ["Measure", "Verifier", "choose_winner", "fallback_ladder", "fastest", "settle"]

log = logging.getLogger("autotune")

_TIMED_S = 3.0
"""Stop timing a configuration once its timed steps add up to this many seconds."""
_MIN_TIMED_S = 1.0
_MAX_TIMED_STEPS = 20
_MAX_ACCUM = 64
_SAME_SPEED = 0.03
"""Predicted throughputs within this fraction are a tie: the smaller peak is verified first."""
_SAME_MEASURED = 0.01
"""Measured throughputs within this fraction are a tie: the smaller peak wins it. Kept
small: every point of it is speed given up, and the target is the best config's speed."""


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
    ) -> None:
        self.model = model
        self.sample = sample
        self.device = device
        self.budget_bytes = budget_bytes
        self.loss_fn = loss_fn
        self.context_bytes = context_bytes
        self.foreign_bytes = foreign_bytes
        self.steps = steps

    def run(self, config: TrainConfig) -> tuple[Measurement | None, str | None]:
        """Measure ``config``: (measurement, None), or (None, why it was rejected)."""
        batch = batching.resize(self.sample, config.effective_batch_size)
        runner: Runner | None = None
        self._release()  # no cached blocks from earlier runs in this config's reserved peak
        try:
            runner = prepare(self.model, config, lr=1e-6, loss_fn=self.loss_fn, device=self.device)
            peak, step_s = self._measure(runner, batch)
        except torch.OutOfMemoryError as exc:
            return None, f"out of memory: {str(exc).splitlines()[0] if str(exc) else 'OOM'}"
        finally:
            if runner is not None:
                runner.optimizer.zero_grad(set_to_none=True)
            del runner
            self._release()
        if peak > self.budget_bytes:
            return None, f"measured peak {peak} bytes exceeds the budget of {self.budget_bytes}"
        return Measurement(peak, step_s, config.effective_batch_size / step_s), None

    def _measure(self, runner: Runner, batch: Any) -> tuple[int, float]:
        budget = self.budget_bytes
        if self.device.type == "cuda":
            with measure_peak(
                self.device,
                budget_bytes=budget,
                context_bytes=self.context_bytes,
                foreign_bytes=self.foreign_bytes,
            ) as reading:
                runner.step(batch)  # warm-up: allocates optimizer state
                times = self._timed_steps(runner, batch)
            return reading.peak_bytes, statistics.median(times)
        # CPU: the first step allocates the optimizer state under the guard, the second
        # is measured at steady state; the timed steps run without the tracker's overhead.
        with measure_peak(self.device, existing=self._state(runner), budget_bytes=budget):
            runner.step(batch)
        with measure_peak(
            self.device, existing=self._state(runner), budget_bytes=budget
        ) as reading:
            runner.step(batch)
        return reading.peak_bytes, statistics.median(self._timed_steps(runner, batch))

    def _timed_steps(self, runner: Runner, batch: Any) -> list[float]:
        """Timed steps: at least ``steps`` and 1 s of them (a window a hiccup cannot own),
        at most 20 steps or 3 s (one step when a step alone is that long)."""
        times = [self._timed(lambda: runner.step(batch))]
        while (
            sum(times) < _TIMED_S
            and len(times) < _MAX_TIMED_STEPS
            and (len(times) < self.steps or sum(times) < _MIN_TIMED_S)
        ):
            times.append(self._timed(lambda: runner.step(batch)))
        return times

    def retime(self, config: TrainConfig) -> float:
        """Seconds per step of ``config`` again, without measuring its peak (it fitted)."""
        batch = batching.resize(self.sample, config.effective_batch_size)
        self._release()
        runner = prepare(self.model, config, lr=1e-6, loss_fn=self.loss_fn, device=self.device)
        try:
            runner.step(batch)  # warm-up
            return statistics.median(self._timed_steps(runner, batch))
        finally:
            runner.optimizer.zero_grad(set_to_none=True)
            del runner
            self._release()

    def record(self, config: TrainConfig, predicted: Measurement) -> TrialRecord:
        """Run ``config`` and wrap the outcome as a :class:`TrialRecord`."""
        measured, error = self.run(config)
        return TrialRecord(config, predicted, measured, error)

    @staticmethod
    def _state(runner: Runner) -> list[torch.Tensor]:
        return state_tensors(runner.model, runner.optimizer, runner.scaler)

    def _timed(self, fn: Callable[[], Any]) -> float:
        self._sync()
        start = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


Measure = Callable[[TrainConfig, Measurement], "TrialRecord | None"]
"""Runs a config for real (or reads its outcome from a study); None: another process has it."""


def choose_winner(measure: Measure, candidates: list[Candidate], *, top: int) -> list[TrialRecord]:
    """Run distinct good candidates until ``top`` of them fit (or ``3 * top`` ran).

    Candidates are taken fastest predicted first, except that predictions within 3% of
    each other count as a tie won by the smaller predicted peak; and a candidate too like
    one already run (same precision, optimizer and checkpointing, a micro-batch within a
    factor of 1.5) is skipped, so that verification tests different ideas.

    Returns:
        The verification records, rejected ones included; the caller picks the winner.
    """
    records: list[TrialRecord] = []
    fitted = 0
    for cand in _distinct(_tie_frugal(candidates)):
        if fitted >= top or len(records) >= 3 * top:
            break
        log.info("verifying %s", cand.config.describe())
        record = measure(cand.config, cand.prediction.measurement)
        if record is None:
            log.info("  another process is verifying it")
            continue
        records.append(record)
        if record.measured is None:
            log.info("  rejected: %s", record.error)
            continue
        fitted += 1
        log.info(
            "  measured %.1f samples/s, peak %s",
            record.measured.samples_per_s,
            format_bytes(record.measured.peak_bytes),
        )
    return records


def _tie_frugal(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first; within 3% of the fastest, the smallest predicted peak first."""
    if not candidates:
        return []
    best = max(c.prediction.measurement.samples_per_s for c in candidates)
    tied = [
        c for c in candidates if c.prediction.measurement.samples_per_s >= (1 - _SAME_SPEED) * best
    ]
    rest = [c for c in candidates if c not in tied]
    tied.sort(key=lambda c: c.prediction.measurement.peak_bytes)
    return tied + rest


def _distinct(candidates: list[Candidate]) -> list[Candidate]:
    """Drop candidates too like an earlier one (see :func:`choose_winner`)."""
    kept: list[Candidate] = []
    for cand in candidates:
        c = cand.config
        if not any(
            (k.config.precision, k.config.optimizer, bool(k.config.checkpoint))
            == (c.precision, c.optimizer, bool(c.checkpoint))
            and max(k.config.micro_batch_size, c.micro_batch_size)
            < 1.5 * min(k.config.micro_batch_size, c.micro_batch_size)
            for k in kept
        ):
            kept.append(cand)
    return kept


def fastest(records: list[TrialRecord]) -> TrialRecord:
    """The record with the highest measured throughput (ties within 1%: smallest peak).

    Raises:
        VerificationError: no configuration fitted.
    """
    passed = [r for r in records if r.measured is not None]
    if not passed:
        raise VerificationError(
            "no candidate configuration ran within the budget on the device; "
            "raise the budget a little or narrow the search space.",
            attempts=tuple(f"{r.config.describe()}: {r.error}" for r in records),
        )
    best = max(r.measured.samples_per_s for r in passed if r.measured is not None)
    # Measured throughputs within noise of the best: the smallest peak is the safer pick.
    tied = [
        r for r in passed if r.measured and r.measured.samples_per_s >= (1 - _SAME_MEASURED) * best
    ]
    return min(tied, key=lambda r: r.measured.peak_bytes if r.measured else 0)


def fallback_ladder(
    measure: Measure, cost: CostModel, study: Study, winner: TrialRecord, records: list[TrialRecord]
) -> list[TrainConfig]:
    """Verified configs with the winner's effective batch and optimizer, fastest first,
    each with a lower measured peak than the one before.

    Besides the candidates already verified, two more are run: the fastest predicted
    config at 3/4 of the winner's peak, and the most frugal one (the smallest micro-batch
    with at most 64 accumulation steps, every block checkpointed, the precision that
    needs least). ``records`` gains their trials.
    """
    config = winner.config
    assert winner.measured is not None
    effective = config.effective_batch_size
    sizes = [b for b in study.sizes if effective % b == 0] or [effective]
    ladder = Study(
        cost,
        sizes,
        study.precisions,
        (config.optimizer,),
        effective,
        int(winner.measured.peak_bytes * 0.75),
        study.checkpointing,
        study.offload_optimizer,
        study.offload_activations,
    )
    names = cost.profile.blocks if study.checkpointing else ()
    # The smallest micro-batch that keeps accumulation sane (at most 64 micro-batches).
    smallest = next((b for b in sizes if effective // b <= _MAX_ACCUM), sizes[-1])
    placements: list[tuple[tuple[str, ...], tuple[str, ...]]] = [(names, ())]
    if study.offload_activations:
        placements.append(((), cost.profile.blocks))
    frugal = [
        c
        for p in study.precisions
        for h in study.offload_optimizer
        for ckpt, off in placements
        if study.host_fits(
            c := TrainConfig(
                micro_batch_size=smallest,
                grad_accum_steps=effective // smallest,
                precision=p,
                checkpoint=ckpt,
                offload_activations=off,
                optimizer=config.optimizer,
                offload_optimizer=h,
            )
        )
    ]
    extra = [c for c in (best_config(ladder),) if c is not None]
    if frugal:
        extra.append(
            min(
                (Candidate(c, cost.predict(c)) for c in frugal),
                key=lambda c: c.prediction.measurement.peak_bytes,
            )
        )
    for cand in extra:
        if all(r.config != cand.config for r in records):
            log.info("verifying fallback %s", cand.config.describe())
            if (record := measure(cand.config, cand.prediction.measurement)) is not None:
                records.append(record)
    same = [
        r
        for r in records
        if r.measured is not None
        and r.config != config
        and r.config.effective_batch_size == effective
        and r.config.optimizer == config.optimizer
    ]
    same.sort(key=lambda r: -r.measured.samples_per_s if r.measured else 0.0)
    out: list[TrainConfig] = []
    last = winner.measured.peak_bytes
    for r in same:
        assert r.measured is not None
        if r.measured.peak_bytes < last:
            out.append(r.config)
            last = r.measured.peak_bytes
    return out


def settle(verifier: Verifier, records: list[TrialRecord], *, rounds: int = 2) -> list[TrialRecord]:
    """Time the close contenders again, interleaved, and keep the median of all timings.

    One timing per candidate is at the mercy of whatever else the machine does for those
    seconds; contenders within 15% of the fastest run ``rounds`` more times, alternating,
    so that a slow spell hits them alike.
    """
    passed = [r for r in records if r.measured is not None]
    if len(passed) < 2:
        return records
    best = max(r.measured.samples_per_s for r in passed if r.measured)
    close = [r for r in passed if r.measured and r.measured.samples_per_s >= 0.85 * best]
    if len(close) < 2:
        return records
    times = {r.config: [r.measured.step_s] for r in close if r.measured}
    for _ in range(rounds):
        for r in close:
            times[r.config].append(verifier.retime(r.config))
    out = []
    for r in records:
        if r.config in times and r.measured is not None:
            step = statistics.median(times[r.config])
            n = r.config.effective_batch_size
            r = dataclasses.replace(
                r, measured=dataclasses.replace(r.measured, step_s=step, samples_per_s=n / step)
            )
        out.append(r)
    return out
