"""The Optuna study over the knobs, and the enumeration of fallback configurations.

Each trial picks a micro-batch size, a precision, an optimizer and whether the optimizer
lives on the host; accumulation follows from the global batch; each block's choice (kept,
checkpointed or offloaded) is then solved exactly for that trial (the cheapest mask that
fits, see :meth:`CostModel.plan`), not sampled block by block. The objective is predicted
throughput; the device budget is a constraint, and so is the host memory offload may pin.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from .config import TrainConfig
from .cost import CHECKPOINT, KEEP, OFFLOAD, CostModel, Mask, Prediction
from .errors import BudgetTooSmallError
from .space import SearchSpace
from .target import format_bytes

__all__ = ["Candidate", "Study", "best_config", "largest_fitting", "too_small"]

log = logging.getLogger("autotune")


@dataclass(frozen=True)
class Candidate:
    """A configuration and its prediction."""

    config: TrainConfig
    prediction: Prediction


@dataclass
class Study:
    """The search over one cost model.

    Args:
        cost: The cost model.
        sizes: Micro-batch sizes allowed (ascending).
        precisions: Precisions to consider.
        optimizers: Optimizers to consider.
        global_batch_size: Fixed samples per optimizer step, or ``None`` (no accumulation).
        limit: Peak bytes a configuration may predict.
        checkpointing: Whether blocks may be checkpointed.
        offload_optimizer: Optimizer placements to consider (``False``: on the device).
        offload_activations: Whether blocks may be offloaded (needs an offload profile).
    """

    cost: CostModel
    sizes: Sequence[int]
    precisions: Sequence[str]
    optimizers: Sequence[str]
    global_batch_size: int | None
    limit: int
    checkpointing: bool = True
    offload_optimizer: Sequence[bool] = (False,)
    offload_activations: bool = False

    def accum(self, b: int) -> int:
        return self.global_batch_size // b if self.global_batch_size else 1

    def mask(
        self, precision: str, optimizer: str, b: int, offload: bool = False, *, acts: bool = True
    ) -> Mask | None:
        """The cheapest fitting mask, or None when nothing fits."""
        n = self.accum(b)
        if self.checkpointing:
            return self.cost.plan(
                precision,
                optimizer,
                b,
                n,
                self.limit,
                offload_optimizer=offload,
                offload_activations=acts and self.offload_activations,
            )
        none = (KEEP,) * self.cost.n_blocks
        fits = self.cost.peak(precision, optimizer, b, n, none, offload_optimizer=offload)
        return none if fits <= self.limit else None

    def candidate(
        self, precision: str, optimizer: str, b: int, offload: bool = False
    ) -> Candidate | None:
        """The cheapest fitting configuration of these knobs and its prediction, or None."""
        config = self.config(precision, optimizer, b, offload)
        return None if config is None else Candidate(config, self.cost.predict(config))

    def config(
        self, precision: str, optimizer: str, b: int, offload: bool = False
    ) -> TrainConfig | None:
        """The cheapest fitting configuration of these knobs, host memory allowing."""
        for acts in (True, False):  # without offloaded activations if the host is too small
            mask = self.mask(precision, optimizer, b, offload, acts=acts)
            if mask is None:
                return None
            blocks = self.cost.profile.blocks
            config = TrainConfig(
                micro_batch_size=b,
                grad_accum_steps=self.accum(b),
                precision=precision,
                checkpoint=tuple(n for n, m in zip(blocks, mask, strict=True) if m == CHECKPOINT),
                offload_activations=tuple(
                    n for n, m in zip(blocks, mask, strict=True) if m == OFFLOAD
                ),
                optimizer=optimizer,
                offload_optimizer=offload,
            )
            if self.host_fits(config):
                return config
            if not config.offload_activations:
                break
        return None

    def host_fits(self, config: TrainConfig) -> bool:
        """Whether the host memory offload would pin stays within the host's limit."""
        transfer = self.cost.profile.transfer
        if transfer is None or not (config.offload_optimizer or config.offload_activations):
            return True
        return self.cost.host_bytes(config) <= transfer.host_limit_bytes

    def frugal_peak(self, precision: str, optimizer: str, b: int, offload: bool) -> int:
        """Predicted peak with every block checkpointed (or offloaded if that saves more)."""
        n, full = self.accum(b), (CHECKPOINT if self.checkpointing else KEEP,) * self.cost.n_blocks
        peak = self.cost.peak(precision, optimizer, b, n, full, offload_optimizer=offload)
        if self.offload_activations and self.checkpointing:
            off = (OFFLOAD,) * self.cost.n_blocks
            peak = min(
                peak, self.cost.peak(precision, optimizer, b, n, off, offload_optimizer=offload)
            )
        return peak

    def run(
        self,
        *,
        n_trials: int | None,
        timeout_s: float | None,
        seed: int,
        storage: str | optuna.storages.BaseStorage | None = None,
        study_name: str | None = None,
    ) -> list[Candidate]:
        """Run the Optuna study; return its distinct feasible candidates, fastest first."""
        sizes = list(self.sizes)
        multi_p, multi_o = len(self.precisions) > 1, len(self.optimizers) > 1
        multi_h = len(self.offload_optimizer) > 1

        def objective(trial: optuna.Trial) -> float:
            if self.global_batch_size is None:
                b = trial.suggest_int("micro_batch_size", sizes[0], sizes[-1], log=True)
                b = sizes[min(range(len(sizes)), key=lambda i: abs(sizes[i] - b))]
            else:
                b = int(trial.suggest_categorical("micro_batch_size", sizes))
            p = (
                str(trial.suggest_categorical("precision", list(self.precisions)))
                if multi_p
                else self.precisions[0]
            )
            o = (
                str(trial.suggest_categorical("optimizer", list(self.optimizers)))
                if multi_o
                else self.optimizers[0]
            )
            h = (
                bool(trial.suggest_categorical("offload_optimizer", list(self.offload_optimizer)))
                if multi_h
                else self.offload_optimizer[0]
            )
            found = self.candidate(p, o, b, h)
            if found is None:
                over = self.frugal_peak(p, o, b, h) - self.limit
                _constrain(trial, float(max(over, 1)))
                return 0.0
            m = found.prediction.measurement
            _constrain(trial, float(m.peak_bytes - self.limit))
            return m.samples_per_s

        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, **_constraint_option())
        with _quiet_optuna():
            study = optuna.create_study(
                direction="maximize",
                sampler=sampler,
                storage=storage,
                study_name=study_name,
                load_if_exists=storage is not None,
            )
            for params in self._seeds():
                study.enqueue_trial(params, skip_if_exists=True)
            # A kept study resumes: trials already done count towards n_trials.
            done = sum(t.state.is_finished() for t in study.trials)
            remaining = max((n_trials or self.default_trials()) - done, 0)
            if remaining:
                total = done + remaining

                def report(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
                    n = trial.number + 1
                    log.debug("trial %d of %d", n, total, extra={"trial": n, "n_trials": total})

                study.optimize(objective, n_trials=remaining, timeout=timeout_s, callbacks=[report])
        seen: dict[tuple[int, str, str, bool], Candidate] = {}
        for t in study.trials:
            if (
                t.state != optuna.trial.TrialState.COMPLETE
                or t.user_attrs.get("constraint", [1])[0] > 0
            ):
                continue
            b = int(t.params.get("micro_batch_size", sizes[0]))
            key = (
                b,
                t.params.get("precision", self.precisions[0]),
                t.params.get("optimizer", self.optimizers[0]),
                bool(t.params.get("offload_optimizer", self.offload_optimizer[0])),
            )
            if (
                b in sizes
                # Another process sharing the study may have searched other choices
                # (e.g. it timed a precision as slow and dropped it): skip what is not ours.
                and key[1] in self.precisions
                and key[2] in self.optimizers
                and key[3] in self.offload_optimizer
                and key not in seen
                and (c := self.candidate(key[1], key[2], b, key[3])) is not None
            ):
                seen[key] = c
        return sorted(seen.values(), key=lambda c: -c.prediction.measurement.samples_per_s)

    def default_trials(self) -> int:
        size = min(len(self.sizes), 64) * len(self.precisions) * len(self.optimizers)
        return max(30, min(200, 2 * size * len(self.offload_optimizer)))

    def _seeds(self) -> Iterator[dict[str, object]]:
        """Good starting points: per precision, the largest micro-batch that fits."""
        for p in self.precisions:
            for h in self.offload_optimizer:
                b = largest_fitting(self, p, self.optimizers[0], h)
                if b is not None:
                    params: dict[str, object] = {"micro_batch_size": b}
                    if len(self.precisions) > 1:
                        params["precision"] = p
                    if len(self.optimizers) > 1:
                        params["optimizer"] = self.optimizers[0]
                    if len(self.offload_optimizer) > 1:
                        params["offload_optimizer"] = h
                    yield params


def largest_fitting(
    study: Study, precision: str, optimizer: str, offload: bool | None = None
) -> int | None:
    """The largest allowed micro-batch size for which some configuration fits (binary search).

    ``offload``: the optimizer placement; ``None``: any the study allows.
    """
    if offload is None:
        found = [largest_fitting(study, precision, optimizer, h) for h in study.offload_optimizer]
        return max((b for b in found if b is not None), default=None)
    sizes = list(study.sizes)
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if study.config(precision, optimizer, sizes[mid], offload) is not None:
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best


def best_config(study: Study) -> Candidate | None:
    """The fastest predicted candidate by exhaustive enumeration (small spaces only)."""
    best: Candidate | None = None
    for p in study.precisions:
        for o in study.optimizers:
            for b, h in itertools.product(study.sizes, study.offload_optimizer):
                c = study.candidate(p, o, b, h)
                if c and (
                    best is None
                    or c.prediction.measurement.samples_per_s
                    > best.prediction.measurement.samples_per_s
                ):
                    best = c
    return best


def _constrain(trial: optuna.Trial, over_budget: float) -> None:
    """Record predicted bytes over the limit (feasible when <= 0) as the trial's constraint."""
    trial.set_user_attr("constraint", [over_budget])
    if _NATIVE_CONSTRAINTS:
        trial.set_constraint("peak_over_limit", over_budget)


# Optuna 5 takes constraints from Trial.set_constraint and deprecates constraints_func;
# older releases only have constraints_func. Both feed the same constrained TPE.
_NATIVE_CONSTRAINTS = hasattr(optuna.trial.Trial, "set_constraint")


def _constraint_option() -> dict[str, Any]:
    if _NATIVE_CONSTRAINTS:
        return {}
    return {"constraints_func": lambda t: t.user_attrs["constraint"]}


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna logs every trial at INFO; silence it for the study only."""
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)


def too_small(study: Study, space: SearchSpace, budget: int) -> BudgetTooSmallError:
    """The error for a budget under the cheapest configuration, with what would lower it."""
    cost = study.cost
    best = None
    b = study.sizes[0]
    for p, o, h in itertools.product(study.precisions, study.optimizers, study.offload_optimizer):
        peak = study.frugal_peak(p, o, b, h)
        if best is None or peak < best[0]:
            best = (peak, p, o, h)
    assert best is not None
    peak, p, o, h = best
    n = study.accum(b)
    full = (CHECKPOINT if study.checkpointing else KEEP,) * cost.n_blocks
    off = (OFFLOAD,) * cost.n_blocks
    mask = full
    if study.offload_activations and cost.peak(p, o, b, n, off, offload_optimizer=h) < cost.peak(
        p, o, b, n, full, offload_optimizer=h
    ):
        mask = off
    blocks = cost.profile.blocks
    config = TrainConfig(
        micro_batch_size=b,
        grad_accum_steps=n,
        precision=p,
        optimizer=o,
        checkpoint=tuple(x for x, m in zip(blocks, mask, strict=True) if m == CHECKPOINT),
        offload_activations=tuple(x for x, m in zip(blocks, mask, strict=True) if m == OFFLOAD),
        offload_optimizer=h,
    )
    _, parts = cost.memory(config)
    hints = ["raise budget_gb"]
    light = [x for x in ("adamw8bit", "adafactor", "sgd") if x in space.optimizers]
    if parts.optimizer > parts.parameters / 2 and not light:
        hints.append(
            "allow a lighter optimizer, e.g. SearchSpace(optimizers=['adamw', 'adamw8bit']) "
            "or 'adafactor'"
        )
    if not h and True not in study.offload_optimizer:
        hints.append("allow optimizer offload (SearchSpace(offload_optimizer=True))")
    if not study.offload_activations and cost.n_blocks:
        hints.append("allow activation offload (SearchSpace(offload_activations=True))")
    if not space.checkpointing:
        hints.append("allow checkpointing (SearchSpace(checkpointing=True))")
    hints.append("tune with shorter sequences or a smaller model")
    where = []
    if config.checkpoint:
        where.append(f"{len(config.checkpoint)} of {cost.n_blocks} blocks checkpointed")
    if config.offload_activations:
        where.append(f"{len(config.offload_activations)} of {cost.n_blocks} blocks offloaded")
    if h:
        where.append("optimizer on the host")
    return BudgetTooSmallError(
        f"the budget of {format_bytes(budget)} is below the minimum this model needs, "
        f"{format_bytes(peak)} (micro-batch {b}, {p}, {o}"
        f"{', ' + ', '.join(where) if where else ''}): parameters "
        f"{format_bytes(parts.parameters)}, gradients {format_bytes(parts.gradients)}, "
        f"optimizer state {format_bytes(parts.optimizer)}, activations "
        f"{format_bytes(parts.activations)}, other {format_bytes(parts.other)}. "
        f"To fit: {'; '.join(hints)}.",
        minimum_bytes=peak,
        budget_bytes=budget,
    )
