"""The Optuna study over the knobs, and the enumeration of fallback configurations.

Each trial picks a micro-batch size, a precision and an optimizer; accumulation follows
from the global batch; the checkpoint mask is then solved exactly for that trial (the
cheapest mask that fits, see :meth:`CostModel.plan`), not sampled block by block. The
objective is predicted throughput; the budget is a constraint (``constraints_func``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from .config import TrainConfig
from .cost import CostModel, Mask, Prediction
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
    """

    cost: CostModel
    sizes: Sequence[int]
    precisions: Sequence[str]
    optimizers: Sequence[str]
    global_batch_size: int | None
    limit: int
    checkpointing: bool = True

    def accum(self, b: int) -> int:
        return self.global_batch_size // b if self.global_batch_size else 1

    def mask(self, precision: str, optimizer: str, b: int) -> Mask | None:
        """The cheapest fitting checkpoint mask, or None when nothing fits."""
        n = self.accum(b)
        if self.checkpointing:
            return self.cost.plan(precision, optimizer, b, n, self.limit)
        none = (False,) * self.cost.n_blocks
        return none if self.cost.peak(precision, optimizer, b, n, none) <= self.limit else None

    def candidate(self, precision: str, optimizer: str, b: int) -> Candidate | None:
        mask = self.mask(precision, optimizer, b)
        if mask is None:
            return None
        names = tuple(n for n, m in zip(self.cost.profile.blocks, mask, strict=True) if m)
        config = TrainConfig(
            micro_batch_size=b,
            grad_accum_steps=self.accum(b),
            precision=precision,
            checkpoint=names,
            optimizer=optimizer,
        )
        return Candidate(config, self.cost.predict(config))

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
            found = self.candidate(p, o, b)
            if found is None:
                full = (self.checkpointing,) * self.cost.n_blocks
                over = self.cost.peak(p, o, b, self.accum(b), full) - self.limit
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
        seen: dict[tuple[int, str, str], Candidate] = {}
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
            )
            if (
                b in sizes
                and key not in seen
                and (c := self.candidate(key[1], key[2], b)) is not None
            ):
                seen[key] = c
        return sorted(seen.values(), key=lambda c: -c.prediction.measurement.samples_per_s)

    def default_trials(self) -> int:
        size = min(len(self.sizes), 64) * len(self.precisions) * len(self.optimizers)
        return max(30, min(200, 2 * size))

    def _seeds(self) -> Iterator[dict[str, object]]:
        """Good starting points: per precision, the largest micro-batch that fits."""
        for p in self.precisions:
            b = largest_fitting(self, p, self.optimizers[0])
            if b is not None:
                params: dict[str, object] = {"micro_batch_size": b}
                if len(self.precisions) > 1:
                    params["precision"] = p
                if len(self.optimizers) > 1:
                    params["optimizer"] = self.optimizers[0]
                yield params


def largest_fitting(study: Study, precision: str, optimizer: str) -> int | None:
    """The largest allowed micro-batch size for which some mask fits (binary search)."""
    sizes = list(study.sizes)
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if study.mask(precision, optimizer, sizes[mid]) is not None:
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best


def best_config(study: Study) -> Candidate | None:
    """The fastest predicted candidate by exhaustive enumeration (small spaces only)."""
    best: Candidate | None = None
    for p in study.precisions:
        for o in study.optimizers:
            for b in study.sizes:
                c = study.candidate(p, o, b)
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
    full = (True,) * cost.n_blocks if study.checkpointing else (False,) * cost.n_blocks
    best = None
    for p in study.precisions:
        for o in study.optimizers:
            b = study.sizes[0]
            peak = cost.peak(p, o, b, study.accum(b), full)
            if best is None or peak < best[0]:
                best = (peak, p, o, b)
    assert best is not None
    peak, p, o, b = best
    names = tuple(n for n, m in zip(cost.profile.blocks, full, strict=True) if m)
    config = TrainConfig(
        micro_batch_size=b,
        grad_accum_steps=study.accum(b),
        precision=p,
        optimizer=o,
        checkpoint=names,
    )
    _, parts = cost.memory(config)
    hints = ["raise budget_gb"]
    if parts.optimizer > parts.parameters and "sgd" not in space.optimizers:
        hints.append(
            "allow a lighter optimizer, e.g. SearchSpace(optimizers=['adamw', 'adafactor'])"
        )
    if not space.checkpointing:
        hints.append("allow checkpointing (SearchSpace(checkpointing=True))")
    hints.append("tune with shorter sequences or a smaller model")
    return BudgetTooSmallError(
        f"the budget of {format_bytes(budget)} is below the minimum this model needs, "
        f"{format_bytes(peak)} (micro-batch {b}, {p}, {o}, {len(names)} of {cost.n_blocks} blocks "
        f"checkpointed): parameters {format_bytes(parts.parameters)}, gradients "
        f"{format_bytes(parts.gradients)}, optimizer state {format_bytes(parts.optimizer)}, "
        f"activations {format_bytes(parts.activations)}, other {format_bytes(parts.other)}. "
        f"To fit: {'; '.join(hints)}.",
        minimum_bytes=peak,
        budget_bytes=budget,
    )
