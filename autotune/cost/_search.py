"""The search over the knobs: exact enumeration, or an Optuna study for a large space.

A point of the space is a micro-batch size, a precision, an optimizer and whether the
optimizer lives on the host; the :class:`~autotune.cost._chooser.Chooser` derives
accumulation and solves each block's choice exactly for it (a knapsack: microseconds).
A space of a few thousand points is therefore enumerated exactly. A larger one (many
micro-batch sizes and no global batch) is searched by Optuna's TPE: the objective is
predicted throughput, the device budget a constraint (not a penalty), and so is the host
memory offload may pin. With a storage, the study keeps the points either way (Optuna's
dashboard shows them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import optuna

from autotune.config import Timeline, TrainConfig
from autotune.cost._candidates import enumerate_candidates, largest_fitting, space_points
from autotune.cost._chooser import Candidate, Chooser
from autotune.jobs import quiet_optuna

__all__ = ["default_trials", "search"]

log = logging.getLogger("autotune")

_Key = tuple[int, Timeline, str, bool]
"""A trial's sampled knobs: micro-batch, timeline, optimizer, optimizer offload (the study
holds the timeline by its name, as its ``precision``)."""


_EXACT_POINTS = 4096
"""A space of at most this many points that can fit is enumerated exactly."""


def search(
    chooser: Chooser,
    *,
    n_trials: int | None,
    timeout_s: float | None,
    seed: int,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str | None = None,
    exact_limit: int | None = None,
) -> list[Candidate]:
    """The distinct feasible candidates of the space, fastest predicted first.

    A space of at most ``exact_limit`` (default 4096) points is enumerated exactly (``n_trials``,
    ``timeout_s`` and ``seed`` do not apply); a larger one runs the Optuna study. A study
    kept in ``storage`` resumes: trials already done count towards ``n_trials``.
    """
    points = space_points(chooser)
    if len(points) <= (_EXACT_POINTS if exact_limit is None else exact_limit):
        log.info("enumerating all %d settings that can fit", len(points))
        found = enumerate_candidates(chooser, points)
        if storage is not None:
            _keep(chooser, found, storage, study_name)
        return found
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, **_constraint_option())
    with quiet_optuna():
        study = optuna.create_study(
            direction="maximize",
            sampler=sampler,
            storage=storage,
            study_name=study_name,
            load_if_exists=storage is not None,
        )
        for params in _seeds(chooser):
            study.enqueue_trial(params, skip_if_exists=True)
        done = sum(t.state.is_finished() for t in study.trials)
        remaining = max((n_trials or default_trials(chooser)) - done, 0)
        if remaining:
            total = done + remaining

            def report(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
                n = trial.number + 1
                log.debug("trial %d of %d", n, total, extra={"trial": n, "n_trials": total})

            study.optimize(
                _objective(chooser), n_trials=remaining, timeout=timeout_s, callbacks=[report]
            )
    return _candidates(chooser, study.trials)


def _keep(
    chooser: Chooser,
    found: list[Candidate],
    storage: str | optuna.storages.BaseStorage,
    study_name: str | None,
) -> None:
    """Add the enumerated candidates to the study as finished trials (once)."""
    with quiet_optuna():
        study = optuna.create_study(
            direction="maximize", storage=storage, study_name=study_name, load_if_exists=True
        )
        if study.trials:
            return
        distributions = _distributions(chooser)
        study.add_trials(
            [
                optuna.trial.create_trial(
                    params={
                        k: v
                        for k, v in zip(_NAMES, _saved(c.config), strict=True)
                        if k in distributions
                    },
                    distributions=distributions,
                    value=c.prediction.measurement.samples_per_s,
                    user_attrs={"constraint": [0.0], "exact": True},
                )
                for c in found
            ]
        )


def default_trials(chooser: Chooser) -> int:
    """Trials for a space of this size: twice its settings, within 30..200."""
    size = min(len(chooser.sizes), 64) * len(chooser.timelines) * len(chooser.optimizers)
    return max(30, min(200, 2 * size * len(chooser.offload_optimizer)))


def _objective(chooser: Chooser) -> Any:
    sizes = list(chooser.sizes)

    def objective(trial: optuna.Trial) -> float:
        if chooser.global_batch_size is None:
            b = trial.suggest_int("micro_batch_size", sizes[0], sizes[-1], log=True)
            b = sizes[min(range(len(sizes)), key=lambda i: abs(sizes[i] - b))]
            trial.set_user_attr("micro_batch_size", b)  # the size planned, not the one drawn
        else:
            b = int(trial.suggest_categorical("micro_batch_size", sizes))
        p = Timeline.named(str(_choose(trial, "precision", _names(chooser.timelines))))
        o = str(_choose(trial, "optimizer", chooser.optimizers))
        h = bool(_choose(trial, "offload_optimizer", chooser.offload_optimizer))
        found = chooser.candidate(p, o, b, h)
        if found is None:
            over = chooser.frugal_peak(p, o, b, h) - chooser.limit
            _constrain(trial, float(max(over, 1)))
            return 0.0
        m = found.prediction.measurement
        _constrain(trial, float(m.peak_bytes - chooser.limit))
        return m.samples_per_s

    return objective


def _choose(trial: optuna.Trial, name: str, choices: Sequence[Any]) -> Any:
    """Sample ``name`` among ``choices``; a single choice is not a parameter of the study."""
    if len(choices) == 1:
        return choices[0]
    return trial.suggest_categorical(name, list(choices))


def _candidates(chooser: Chooser, trials: Sequence[optuna.trial.FrozenTrial]) -> list[Candidate]:
    """The distinct feasible settings among ``trials``, each planned again, fastest first."""
    seen: dict[_Key, Candidate] = {}
    for t in trials:
        if (
            t.state != optuna.trial.TrialState.COMPLETE
            or t.user_attrs.get("constraint", [1])[0] > 0
        ):
            continue
        key: _Key = (
            int(t.user_attrs.get("micro_batch_size", t.params.get("micro_batch_size", 0))),
            Timeline.named(t.params.get("precision", str(chooser.timelines[0]))),
            t.params.get("optimizer", chooser.optimizers[0]),
            bool(t.params.get("offload_optimizer", chooser.offload_optimizer[0])),
        )
        b, p, o, h = key
        if (
            b in chooser.sizes
            # Another process sharing the study may have searched other choices
            # (e.g. it timed a precision as slow and dropped it): skip what is not ours.
            and p in chooser.timelines
            and o in chooser.optimizers
            and h in chooser.offload_optimizer
            and key not in seen
            and (c := chooser.candidate(p, o, b, h)) is not None
        ):
            seen[key] = c
    return sorted(seen.values(), key=lambda c: -c.prediction.measurement.samples_per_s)


_NAMES = ("micro_batch_size", "precision", "optimizer", "offload_optimizer")


def _saved(config: TrainConfig) -> tuple[int, str, str, bool]:
    """The study's values of ``config``'s sampled knobs, in the order of :data:`_NAMES`."""
    b, timeline = config.micro_batch_size, str(config.timeline)
    return (b, timeline, config.optimizer, config.offload_optimizer)


def _names(timelines: Sequence[Timeline]) -> list[str]:
    """The study's values of ``timelines``: their names."""
    return [str(t) for t in timelines]


def _distributions(chooser: Chooser) -> dict[str, optuna.distributions.BaseDistribution]:
    """The study's parameters: the knobs with more than one choice."""
    out: dict[str, optuna.distributions.BaseDistribution] = {
        "micro_batch_size": optuna.distributions.CategoricalDistribution(list(chooser.sizes))
    }
    choices: dict[str, Sequence[str | bool]] = {
        "precision": _names(chooser.timelines),
        "optimizer": chooser.optimizers,
        "offload_optimizer": chooser.offload_optimizer,
    }
    for name, values in choices.items():
        if len(values) > 1:
            out[name] = optuna.distributions.CategoricalDistribution(list(values))
    return out


def _seeds(chooser: Chooser) -> Iterator[dict[str, object]]:
    """Good starting points: per timeline, the largest micro-batch that fits."""
    for p in chooser.timelines:
        for h in chooser.offload_optimizer:
            b = largest_fitting(chooser, p, chooser.optimizers[0], h)
            if b is not None:
                params: dict[str, object] = {"micro_batch_size": b}
                if len(chooser.timelines) > 1:
                    params["precision"] = str(p)
                if len(chooser.optimizers) > 1:
                    params["optimizer"] = chooser.optimizers[0]
                if len(chooser.offload_optimizer) > 1:
                    params["offload_optimizer"] = h
                yield params


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
