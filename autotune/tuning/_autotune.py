"""``autotune()``: the tuner's entry, and the runs it makes of one call.

A call is a table of runs: one per sequence length (``sequence_lengths``; else the
sample's), each of them one per attention implementation (``SearchSpace.attention``; else
the model's), each a tuning run of its own (:func:`~autotune.tuning._device_run.tune_on_device`).

**The lengths** (:func:`tune_lengths`). Activation memory grows with a batch's length, so
a config tuned at the longest length wastes the budget on every shorter batch. Each
length of the table is tuned as a run of its own on the sample batch cut to that length,
the longest first. The rows keep the optimizer step's meaning (the global batch in
samples, or in tokens: ``tokens / length`` samples) and the longest row's precision and
optimizer, so training switches between rows with the same math and optimizer state.
Where the longest keeps the optimizer on the device, so do the others (a switch would
move its state through the host).

**The attention implementations** (:func:`tune_attentions`). They compute the same
attention (within the dtype's tolerance) but differ in memory (eager keeps the attention
matrix for backward) and speed, which depend on the device, the dtype and the length:
measured, never assumed. The user's model is set to each in turn and put back as it was;
every config of the result names its implementation, which ``prepare()`` sets; the
fastest verified winner of them all wins.

Tuning that starts from a plan (``autotune plan``'s YAML) or from an earlier result.

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
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune._spelling import option
from autotune.config import TrainConfig, is_factory
from autotune.errors import (
    BatchError,
    BlockError,
    BudgetTooSmallError,
    ConfigError,
    ProfileError,
    VerificationError,
)
from autotune.result import LengthRow, Spent, TrialRecord, TuneResult, load
from autotune.space import SearchSpace
from autotune.train import (
    LossFn,
    OptimizerFactory,
    available,
    factory_name,
    group_size,
    not_at_hand,
    refuse_another_model,
    sequence_length,
    set_attention,
    truncate,
)
from autotune.tuning._device_run import tune_on_device
from autotune.tuning._options import TuneOptions
from autotune.tuning._problem import Problem, make_problem, uncompiled
from autotune.tuning._progress import showing_progress, shown

__all__ = [
    "Lengths",
    "autotune",
    "plan_record",
    "resolved_plan",
    "started_from",
    "tune",
    "tune_attentions",
    "tune_lengths",
    "with_optimizer",
]

log = logging.getLogger("autotune")


def autotune(
    model: nn.Module,
    sample_batch: Any,
    budget_gb: float = 24.0,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | str | None = None,
    eval_batch_size: int | None = None,
    global_batch_size: int | None = None,
    global_batch_tokens: int | None = None,
    sequence_lengths: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    space: SearchSpace | None = None,
    n_trials: int | None = None,
    timeout_s: float | None = None,
    max_tuning_s: float | None = None,
    seed: int = 0,
    storage: str | None = None,
    study_name: str | None = None,
    world_size: int | None = None,
    start_from: TuneResult | str | Path | None = None,
    progress: bool | None = None,
) -> TuneResult:
    """Find the fastest training configuration of ``model`` whose peak memory fits the budget.

    Args:
        model: The model to tune; left exactly as it was.
        sample_batch: One batch (Tensor, tuple/list or dict; batch dimension 0); batches of
            any size are made from it. Tune at the longest sequence you will train on.
        budget_gb: Device memory the training run may use, in GiB.
        loss_fn: ``loss_fn(output, batch) -> scalar``; default: a scalar output,
            ``output.loss``, or the first element of a tuple output.
        optimizer: Your optimizer: a function that builds a ``torch.optim.Optimizer``
            from a list of the model's trainable parameters, or from the model itself
            where its first parameter is named ``model`` (parameter groups), or an
            optimizer class; or its import path ``module:name``. Its state and step are
            measured and verified like the named ones, offloaded to the host where the
            space allows; the result records its path, and :func:`autotune.prepare` takes
            it again. It takes the place of the space's first optimizer (default
            ``adamw``, built with ``prepare(..., lr=)``).
        eval_batch_size: The evaluation batch you want, checked: every config verified
            records in ``eval_batch_size`` the largest evaluation batch (a no-grad forward
            with its loss, after a training step) that fits the budget beside its
            training state, or this one where it fits (a warning where it does not). The
            exports set it (``per_device_eval_batch_size``).
        global_batch_size: Samples per optimizer step, kept exact with accumulation;
            default: no accumulation, the micro-batch is the batch.
        global_batch_tokens: Tokens per optimizer step instead (``global_batch_size``
            samples of the sequence length): at each length, ``tokens / length`` samples,
            exact, so every length must divide it.
        sequence_lengths: Tune a table: for each of these lengths (the sample batch at
            the longest), the fastest verified config for batches padded up to it, in
            ``result.by_length``; the runner trains each batch with its length's row and
            :class:`autotune.LengthBucketSampler` makes the batches. Every row keeps the
            optimizer step's meaning (the global batch, in samples or tokens), the
            precision and the optimizer of the longest, so the math is the same.
        device: Target device; default CUDA if available, else CPU.
        space: Knobs to search; default :class:`SearchSpace()`.
        n_trials: Optuna trials on the cost model, for a space too large to enumerate
            (default: scaled to the space); a space of up to 4096 settings that can fit
            is enumerated exactly.
        timeout_s: Time limit of the Optuna study (a large space only).
        max_tuning_s: Seconds the whole run may take. Profiling and the first
            candidate's verification always run; after them each run of a config (more
            candidates, the expert's recipe, re-timing, fallbacks, the evaluation batch)
            starts only where one as long as the longest so far still ends in time, and
            ``result.skipped`` says what was not run (each length of a table, and each
            attention tried, a run of its own; not in a process group, whose ranks
            verify in step). ``None``: no limit.
        seed: Seed of the study; the same profile gives the same configuration.
        storage: Where to keep the study, to resume it or share it between processes: an
            Optuna URL (``sqlite:///tune.db``, ``postgresql://...``), a ``*.journal`` file
            path (a journal file, for several processes), or another path (SQLite). The
            study keeps the profile and every verification, which are not redone.
        study_name: Name of the study in the storage; default: from the model and budget.
        world_size: Ranks to train on with data parallelism (DDP or FSDP2, searched). Inside
            a process group (``torchrun``) every rank calls this and the group is tuned on
            (default: its size); every rank returns the same result. In one process, a
            world size other than 1 is planned without running it, and the result's
            ``unverified`` says what that leaves out. The global batch is
            ``micro x accumulation x world_size``.
        start_from: A plan made without the device (:func:`autotune.plan_ahead`, or the
            YAML of ``autotune plan``) or an earlier result: its config is verified on
            the device first, beside the tuner's own candidates (its record in
            ``trials``: the plan's prediction against the measurement); the fastest
            measured wins. Its global batch is the default; its world size must be this
            run's.
        progress: Show the run's progress on stderr (stage, configurations verified, the
            best so far, and a busy machine); default: where a person watches (a terminal
            or a notebook) and no logging is set up (else the ``autotune`` logger's records
            go where your logging sends them). ``False`` silences it.

    Returns:
        The verified winner, its predicted and measured numbers, and fallbacks (with
        ``sequence_lengths``: those of the longest, and the table).

    Raises:
        BudgetError, BudgetTooSmallError, BatchError, LossError, BlockError, ProfileError,
        VerificationError: each with a message that says what to do.
    """
    options = TuneOptions(
        budget_gb=budget_gb,
        loss_fn=loss_fn,
        global_batch_size=global_batch_size,
        global_batch_tokens=global_batch_tokens,
        sequence_lengths=sequence_lengths,
        device=device,
        space=with_optimizer(space or SearchSpace(), optimizer),
        n_trials=n_trials,
        timeout_s=timeout_s,
        max_tuning_s=max_tuning_s,
        seed=seed,
        storage=storage,
        study_name=study_name,
        world_size=world_size,
        start_from=resolved_plan(start_from),
        progress=progress,
        eval_batch_size=eval_batch_size,
    )
    return tune(model, sample_batch, options)


def tune(model: nn.Module, sample_batch: Any, options: TuneOptions) -> TuneResult:
    """:func:`autotune` with its options in one record (what the Lightning callback and
    the command line call)."""
    model = uncompiled(model)
    options = started_from(options, model)
    with showing_progress(quiet=not shown(options.progress)):
        if options.table:
            return tune_lengths(model, sample_batch, options)
        return tune_attentions(model, make_problem(model, sample_batch, options), options)


def with_optimizer(space: SearchSpace, optimizer: OptimizerFactory | str | None) -> SearchSpace:
    """``space`` with the user's optimizer factory (registered here) as its first
    optimizer, in the place of the default one."""
    if optimizer is None:
        return space
    name = factory_name(optimizer)
    rest = tuple(o for o in space.optimizers[1:] if o != name)
    return dataclasses.replace(space, optimizers=(name, *rest))


def tune_attentions(model: nn.Module, problem: Problem, options: TuneOptions) -> TuneResult:
    """One tuning run per implementation of ``options.space.attention`` (one with the
    model's own where it names none); the fastest verified result, with every run's
    trials and seconds.

    Raises:
        ConfigError: the model has no implementation to choose, or one is not installed.
        BudgetTooSmallError, BatchError, ProfileError, VerificationError: no
            implementation fits or runs (the first's error).
    """
    if not options.space.attention:
        return tune_on_device(model, problem, options)
    results: list[TuneResult] = []
    failed: list[Exception] = []
    for name in options.space.attention:
        put_back = set_attention(model, name)
        try:
            log.info("tuning with attention %s", name)
            result = tune_on_device(model, problem, options)
        except (BudgetTooSmallError, BatchError, ProfileError, VerificationError) as exc:
            log.info("attention %s: %s", name, str(exc).splitlines()[0])
            failed.append(exc)
            continue
        finally:
            put_back()
        results.append(_named(result, name))
    if not results:
        raise failed[0]
    best = max(results, key=lambda r: (r.measured or r.predicted).samples_per_s)
    return dataclasses.replace(
        best,
        trials=tuple(t for r in results for t in r.trials),
        tuning_s=sum(r.tuning_s for r in results),
        spent=sum((r.spent for r in results), Spent()),
    )


def _named(result: TuneResult, name: str) -> TuneResult:
    """``result`` with every config naming attention implementation ``name``."""

    def named(c: TrainConfig) -> TrainConfig:
        return c.replace(attention=name)

    return dataclasses.replace(
        result,
        config=named(result.config),
        fallbacks=tuple(named(f) for f in result.fallbacks),
        trials=tuple(dataclasses.replace(t, config=named(t.config)) for t in result.trials),
    )


@dataclass(frozen=True)
class Lengths:
    """The lengths of a table and the samples of one optimizer step at each."""

    lengths: tuple[int, ...]
    """Ascending; the last is the longest."""
    samples: tuple[int, ...]
    """The global batch, in samples, at each length."""

    @staticmethod
    def of(
        sample: Any,
        lengths: Sequence[int] | None,
        global_batch_size: int | None,
        global_batch_tokens: int | None,
    ) -> Lengths:
        """Check the table's arguments (fast, before anything runs).

        Raises:
            ConfigError: what is wrong with them, and what to pass instead.
            BatchError: the sample batch has no sequence dimension.
        """
        full = sequence_length(sample)
        if lengths is None:
            lengths = (full,)
        ordered = tuple(sorted(set(lengths)))
        if ordered[-1] > full:
            raise ConfigError(
                f"the sample batch is {full} long but {option('sequence_lengths')} goes to "
                f"{ordered[-1]}: "
                "pass a sample batch at the longest length you will train on."
            )
        if global_batch_tokens is not None:
            uneven = [n for n in ordered if global_batch_tokens % n]
            if uneven:
                raise ConfigError(
                    f"{option('global_batch_tokens')} {global_batch_tokens} is not a whole "
                    "number of "
                    f"samples at length {uneven[0]}: use a multiple of every length."
                )
            samples = tuple(global_batch_tokens // n for n in ordered)
        elif global_batch_size is not None:
            samples = tuple(global_batch_size for _ in ordered)
        else:
            raise ConfigError(
                "a table per sequence length needs the optimizer step to mean the same at "
                f"every length: pass {option('global_batch_size')} (samples) or "
                f"{option('global_batch_tokens')}."
            )
        return Lengths(ordered, samples)


def tune_lengths(model: nn.Module, sample: Any, options: TuneOptions) -> TuneResult:
    """Tune each length of the table ``options`` asks for (the longest first) and join
    the rows into one result: the longest's, with ``by_length``.

    Raises:
        ConfigError: the table's lengths do not fit the sample or the step, or data
            parallelism was asked for (not supported yet).
        BatchError: the sample batch has no sequence dimension.
    """
    lengths = Lengths.of(
        sample, options.sequence_lengths, options.global_batch_size, options.global_batch_tokens
    )
    if options.parallel or group_size() > 1:
        raise ConfigError(
            f"{option('sequence_lengths')} and {option('global_batch_tokens')} are not "
            "supported with data parallelism yet; tune at the longest length with "
            f"{option('global_batch_size')}."
        )
    started = time.perf_counter()
    rows: list[LengthRow] = []
    results: list[TuneResult] = []
    row = options.replace(sequence_lengths=None, global_batch_tokens=None)
    for length, samples in reversed(list(zip(lengths.lengths, lengths.samples, strict=True))):
        log.info("tuning at sequence length %d (%d samples per step)", length, samples)
        row = row.replace(global_batch_size=samples)
        problem = make_problem(model, truncate(sample, length), row)
        result = tune_attentions(model, problem, row)
        if not results:  # the longest fixes the math of every row, and where the state lives
            row = row.replace(space=_as_tuned(row.space, result.config))
        results.append(result)
        rows.insert(
            0, LengthRow(length, result.config, result.predicted, result.measured, result.fallbacks)
        )
    return dataclasses.replace(
        results[0],
        by_length=tuple(rows),
        tuning_s=time.perf_counter() - started,
        spent=sum((r.spent for r in results), Spent()),
    )


def _as_tuned(space: SearchSpace, config: TrainConfig) -> SearchSpace:
    """``space`` with the precision and optimizer of ``config`` (the longest length's),
    and its optimizer on the device where that one's is."""
    return dataclasses.replace(
        space,
        precisions=(config.precision,),
        optimizers=(config.optimizer,),
        offload_optimizer=space.offload_optimizer if config.offload_optimizer else False,
    )


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
