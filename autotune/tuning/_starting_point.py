"""Tuning that starts from a plan (``autotune plan``'s YAML) or from an earlier result.

The config it names is verified on the device first, beside the tuner's own candidates,
so the result's ``trials`` hold what the plan predicted against what the device measured
for it; the fastest measured config wins, the plan's or another. The plan fixes what the
run is for: its global batch, which this run takes where it is not told it and must
otherwise share, and its world size, which must be this process group's (a plan for 8
ranks is verified under ``torchrun`` with 8).
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from torch import nn

from autotune.config import TrainConfig, is_factory
from autotune.errors import BlockError, ConfigError
from autotune.result import TrialRecord, TuneResult, load
from autotune.train import available, group_size, not_at_hand, refuse_another_model
from autotune.tuning._options import TuneOptions

__all__ = ["plan_record", "resolved_plan", "started_from"]


def resolved_plan(start_from: TuneResult | str | Path | None) -> TuneResult | None:
    """A plan or result, read from its YAML file where given a path.

    Raises:
        ConfigError: no such file, or not a result autotune wrote.
    """
    if start_from is None or isinstance(start_from, TuneResult):
        return start_from
    if isinstance(start_from, str | Path):
        return load(start_from)
    raise ConfigError(
        "start_from must be a TuneResult (autotune.plan_ahead's or autotune's) or the path "
        f"of its YAML file, got {type(start_from).__name__}."
    )


def started_from(options: TuneOptions, model: nn.Module) -> TuneOptions:
    """``options`` with the plan's global batch where none is given, and its precision and
    optimizer in the space.

    Raises:
        ConfigError: the plan is for another model (checked before anything runs), a
            table per sequence length (one config cannot start it), a world size or a
            global batch other than the plan's.
        BlockError: the plan's config names a block the model lacks (a hand-edited
            file), checked before anything runs too.
    """
    plan = options.start_from
    if plan is None:
        return options
    refuse_another_model(
        plan.model,
        model,
        "the plan",
        "plan this model (autotune plan, or autotune.plan_ahead), or tune it without one.",
    )
    c = plan.config
    _check_blocks(c, model)
    if options.table:
        raise ConfigError(
            "a run that starts from a plan verifies its one config: tune a table per "
            "sequence length without it."
        )
    group = group_size()  # its ranks must all be here, to verify the plan on
    if c.world_size != group or options.world_size not in (None, group):
        launch = f"under torchrun --nproc-per-node {c.world_size}" if c.world_size > 1 else "alone"
        raise ConfigError(
            f"the plan is for {c.world_size} rank(s) ({c.describe()}) and this run has "
            f"{group} process(es): start it {launch}, or plan again for {group}."
        )
    batch = options.global_batch_size or c.global_batch_size
    if batch != c.global_batch_size:
        raise ConfigError(
            f"the plan's global batch is {c.global_batch_size} samples and this run's "
            f"{batch}: leave the global batch out to take the plan's, or plan again."
        )
    if is_factory(c.optimizer) and not available(c.optimizer):
        raise not_at_hand(c.optimizer)  # a path read from a file is never imported
    space = options.space
    space = dataclasses.replace(  # profiled, so that the plan's config is predicted too
        space,
        precisions=_with(space.precisions, c.precision),
        optimizers=_with(space.optimizers, c.optimizer),
    )
    return options.replace(global_batch_size=batch, space=space)


_NAMING_BLOCKS = (
    "checkpoint",
    "selective_checkpoint",
    "offload_activations",
    "compile_blocks",
    "keep_gathered",
)
"""The fields of a config that name blocks."""


def _check_blocks(config: TrainConfig, model: nn.Module) -> None:
    """Every block ``config`` names is a submodule of ``model`` (a hand-edited file may
    name one it lacks): checked before anything runs.

    Raises:
        BlockError: a name that is not a submodule of ``model``.
    """
    known = dict(model.named_modules())
    for field in _NAMING_BLOCKS:
        for name in getattr(config, field):
            if name and name in known:
                continue
            close = difflib.get_close_matches(str(name), [k for k in known if k], n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise BlockError(
                f"the plan's {field} names {name!r}, not a submodule of this "
                f"{type(model).__name__}{hint}; correct the name in the file, or tune "
                "without the plan."
            )


def _with(names: tuple[str, ...], name: str) -> tuple[str, ...]:
    return names if name in names else (*names, name)


def plan_record(result: TuneResult, plan: TuneResult) -> TrialRecord | None:
    """The verification of ``plan``'s config among ``result``'s trials (None: not run)."""
    return next((t for t in result.trials if t.config == plan.config), None)
