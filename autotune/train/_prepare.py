"""``prepare()`` and ``apply()``: a model and a :class:`TrainConfig` made into a runner that
trains as tuned, or into a handle for a loop of one's own."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from autotune.config import TrainConfig, is_factory
from autotune.device import backend_for, resolve_device
from autotune.errors import ConfigError, warn
from autotune.result import TuneResult
from autotune.train._applied import Applied
from autotune.train._attention import disable_kv_cache
from autotune.train._batch_layout import layouts_of_model
from autotune.train._checkpoint import disable_hf_checkpointing
from autotune.train._compiled import load_compile_cache
from autotune.train._identity import differences
from autotune.train._loss import LossFn, LossMean, check_loss_mean
from autotune.train._optimizers import (
    OptimizerFactory,
    factory_name,
    not_at_hand,
    registered,
)
from autotune.train._parallel import check_group
from autotune.train._quantized import model_tensors
from autotune.train._runner import Runner

__all__ = ["apply", "prepare"]


def prepare(
    model: nn.Module,
    config: TrainConfig | TuneResult,
    *,
    lr: float | None = None,
    optimizer: OptimizerFactory | str | None = None,
    other_optimizer: bool = False,
    loss_fn: LossFn | None = None,
    loss_mean: LossMean | None = None,
    device: torch.device | str | None = None,
    strict: bool = False,
    blocks: Sequence[str] | None = None,
) -> Runner:
    """Make ``model`` train exactly as ``config`` says, one :meth:`Runner.step` at a time.

    The model is moved to the device, put in train mode, its checkpointed and offloaded
    blocks are wrapped (undone by ``runner.close()``), and a Hugging Face model's
    ``use_cache`` is turned off in every config it holds (a key/value cache is for
    generation, not training), and so is its own gradient checkpointing of every layer
    (``gradient_checkpointing_enable()``, which peft's ``prepare_model_for_kbit_training``
    calls): the config's checkpoint mask says which blocks recompute. Both stay off after
    ``runner.close()``; :func:`apply`'s ``undo()`` puts them back.

    Args:
        model: The model to train (modified in place).
        config: A :class:`TrainConfig`, or a :class:`TuneResult` (its ``config``).
        lr: Learning rate of a named optimizer (default 3e-4); a factory sets its own.
        optimizer: Your optimizer factory (see :func:`autotune.autotune`), or its import
            path ``module:name``: needed for a result tuned with one (its path is in the
            config), unless it was passed earlier in this process. With a
            :class:`TrainConfig` it replaces the config's optimizer.
        other_optimizer: With a :class:`TuneResult` tuned with another optimizer than
            ``optimizer``, train with ``optimizer`` anyway (its memory was not measured:
            the budget may not hold) instead of raising ConfigError.
        loss_fn: ``loss_fn(output, batch) -> scalar``; default: a scalar output,
            ``output.loss``, or the first element of a tuple output.
        loss_mean: What the loss is a mean over, so what each micro-batch weighs in the
            step's mean: ``"samples"``, ``"tokens"`` (the label tokens that count,
            ``labels`` not -100) or ``"next_tokens"`` (the same less each row's first, a
            causal language model's); default: the model's own loss's (a Hugging Face
            language model's tokens), else samples. Say it for a ``loss_fn`` that is a
            token mean, so that the step equals one over the whole batch.
        device: Where to train; default: the device a result was tuned on if it is
            available here, else CUDA if available, else CPU.
        strict: With a result tuned on another model structure, device or torch version:
            raise ConfigError instead of warning.
        blocks: The blocks, FSDP's units with ``parallel: fsdp``; default: the blocks a
            result was tuned with, else :func:`autotune.find_blocks`.

    Given a :class:`TuneResult`, the runner falls back down ``result.fallbacks`` when a
    step runs out of memory (see :meth:`Runner.step`), and on a device with a caching
    allocator (CUDA) it caps the allocator at the result's budget, as verification did,
    until the runner is closed. A result tuned per sequence length (``by_length``) trains
    each batch with the row of its padded length, each row with its own fallbacks. A
    result whose configs compile starts from the code its tuning run compiled
    (:attr:`TuneResult.compile_cache`, saved beside its YAML).
    """
    check_loss_mean(loss_mean)  # before the model moves
    config = _optimizer_in(config, optimizer, lr, other_optimizer, needed=True)
    config, result, target, foreign = _setup(model, config, device, strict, "prepare")
    model.train()
    disable_kv_cache(model)  # prepare() owns the model for training: left off
    disable_hf_checkpointing(model)  # the config's mask says what recomputes
    fallbacks = result.fallbacks if result is not None else ()
    units = _units(blocks, result)
    table = result.by_length if result is not None else ()
    runner = Runner(
        model,
        config,
        lr=lr,
        loss_fn=loss_fn,
        device=target,
        fallbacks=fallbacks,
        units=units,
        table=table,
        written=result.model.written if result is not None else None,
        loss_mean=loss_mean,
    )
    _hold(runner, result, foreign)
    return runner


def apply(
    model: nn.Module,
    config: TrainConfig | TuneResult,
    *,
    lr: float | None = None,
    optimizer: OptimizerFactory | str | None = None,
    other_optimizer: bool = False,
    loss_mean: LossMean | None = None,
    device: torch.device | str | None = None,
    strict: bool = False,
    blocks: Sequence[str] | None = None,
) -> Applied:
    """Apply ``config`` to ``model`` in place, for a training loop of your own (or a
    trainer's), and return the handle that holds the rest of it.

    The model is moved to the device, its blocks are checkpointed and offloaded exactly
    as the config says, and a Hugging Face model's ``use_cache`` is turned off in every
    config it holds, and so is its own gradient checkpointing of every layer;
    ``handle.undo()`` takes the wrappers off and turns the caches and the checkpointing back
    on (the model stays on the device, its weights as trained). Its train/eval mode is left
    as it is. The handle gives the loop the micro-batches with their loss weights, the
    autocast context, the GradScaler, the optimizer the config names (built on first use
    with ``lr``, or by your ``optimizer`` factory), the optimizer step (with clipping and a
    scheduler) and, given a
    :class:`TuneResult`, the fallback ladder (:meth:`Applied.run`) and the allocator's cap
    at the result's budget. The arguments are :func:`prepare`'s; ``loss_mean`` says what
    the loss your loop takes is a mean over (default: the model's own loss's), which
    :meth:`Applied.micro_batches` weighs each micro-batch by.
    """
    check_loss_mean(loss_mean)  # before the model moves
    config = _optimizer_in(config, optimizer, lr, other_optimizer, needed=False)
    config, result, target, foreign = _setup(model, config, device, strict, "apply")
    fallbacks = result.fallbacks if result is not None else ()
    units = _units(blocks, result)
    table = result.by_length if result is not None else ()
    handle = Applied(
        model,
        config,
        lr=lr,
        device=target,
        fallbacks=fallbacks,
        units=units,
        table=table,
        written=result.model.written if result is not None else None,
        loss_mean=loss_mean,
    )
    handle.on_undo(disable_kv_cache(model))
    handle.on_undo(disable_hf_checkpointing(model))
    if any(c.chunked_loss for c in handle.configs) and not handle.takes_chunked_loss:
        warn(
            "this config chunks the loss, which your loop takes: take it as "
            "autotune.chunked_loss(model, batch) (the whole logits hold more than tuned).",
        )
    _hold(handle, result, foreign)
    return handle


def _optimizer_in(
    config: TrainConfig | TuneResult,
    optimizer: OptimizerFactory | str | None,
    lr: float | None,
    other: bool,
    needed: bool,
) -> TrainConfig | TuneResult:
    """``config`` with the user's optimizer factory registered, checked against the one a
    result was tuned with, and put in its place in a :class:`TrainConfig`. ``needed``: the
    optimizer is built now (a runner), so its factory must be at hand; :func:`apply`
    builds it on first use, and a trainer's callback never does (the trainer's is used)."""
    tuned = config.config.optimizer if isinstance(config, TuneResult) else None
    if optimizer is None:
        name = getattr(config.config if isinstance(config, TuneResult) else config, "optimizer", "")
        if is_factory(name):
            _no_lr(name, lr)
            if needed and not registered(name):  # a path in a file is never imported on its own
                raise not_at_hand(name)
        return config
    name = factory_name(optimizer)
    _no_lr(name, lr)
    if tuned is not None and tuned != name and not other:
        raise ConfigError(
            f"this result was tuned with optimizer {tuned}, not {name}: its memory and speed "
            "were measured with that one. Tune again with yours (autotune(..., "
            "optimizer=...)), or pass other_optimizer=True to train with it on this config "
            "anyway."
        )
    if isinstance(config, TuneResult):
        return _with_optimizer(config, name)
    return config.replace(optimizer=name) if isinstance(config, TrainConfig) else config


def _no_lr(name: str, lr: float | None) -> None:
    if lr is not None:
        raise ConfigError(
            f"lr= is the learning rate of the optimizers autotune names; your factory {name} "
            "sets its own: leave lr out."
        )


def _with_optimizer(result: TuneResult, name: str) -> TuneResult:
    """``result`` with every config in it (winner, fallbacks, rows) training ``name``."""

    def each(configs: Sequence[TrainConfig]) -> tuple[TrainConfig, ...]:
        return tuple(c.replace(optimizer=name) for c in configs)

    rows = tuple(
        dataclasses.replace(r, config=r.config.replace(optimizer=name), fallbacks=each(r.fallbacks))
        for r in result.by_length
    )
    return dataclasses.replace(
        result,
        config=result.config.replace(optimizer=name),
        fallbacks=each(result.fallbacks),
        by_length=rows,
        tied=each(result.tied),
    )


def _setup(
    model: nn.Module,
    config: TrainConfig | TuneResult,
    device: torch.device | str | None,
    strict: bool,
    caller: str,
) -> tuple[TrainConfig, TuneResult | None, torch.device, int]:
    """Check the arguments, move the model: the config, the result, the device, and what
    other tensors held on it."""
    if isinstance(config, TuneResult):
        result: TuneResult | None = config
        config = config.config
    else:
        result = None
    if not isinstance(config, TrainConfig):
        raise ConfigError(
            f"{caller}() takes a TrainConfig or a TuneResult, got {type(config).__name__}; "
            "load a YAML file with autotune.load(path)."
        )
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{caller}() takes a torch.nn.Module, got {type(model).__name__}.")
    layouts_of_model(model)  # its batches cut into samples as its config says
    if config.parallel != "none":  # before anything changes the model
        check_group(config)
    target = _default_device(device, result)
    if result is not None and (found := differences(result, model, target)):
        message = "this config may not fit here: " + "; ".join(found) + ". Tune again here."
        if strict:
            raise ConfigError(message)
        warn(message)
    foreign = _foreign_bytes(model, target) if result is not None else 0
    if result is not None and result.compiles:  # before anything compiles
        load_compile_cache(result.compile_cache)
    # fully_shard puts each rank's shards on the device. A model already there is left be:
    # a model of fake tensors (traced, never materialised) cannot be moved at all.
    if config.parallel != "fsdp" and not _on(model, target):
        model.to(target)
    for p in model.parameters():
        p.grad = None
    return config, result, target, foreign


def _units(blocks: Sequence[str] | None, result: TuneResult | None) -> tuple[str, ...]:
    if blocks is not None:
        return tuple(blocks)
    return result.model.blocks if result is not None else ()


def _hold(handle: Applied, result: TuneResult | None, foreign: int) -> None:
    """Train within the budget a result was verified under."""
    if result is not None:
        context = result.target.context_bytes
        handle.hold_budget(result.budget_bytes, context_bytes=context, foreign_bytes=foreign)


def _default_device(device: torch.device | str | None, result: TuneResult | None) -> torch.device:
    if device is not None:
        return resolve_device(device)
    if result is not None:
        tuned = torch.device(result.target.device)
        if tuned.type == "cpu" or (tuned.type == "cuda" and torch.cuda.is_available()):
            return resolve_device(tuned)
    return resolve_device(None)


def _on(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``model`` is on ``device`` already."""
    return all(t.device == device for t in (*model.parameters(), *model.buffers()))


def _foreign_bytes(model: nn.Module, device: torch.device) -> int:
    """What the allocator of ``device`` holds for tensors other than ``model``'s."""
    backend = backend_for(device)
    if not backend.caching:
        return 0
    own = {id(t): t for t in model_tensors(model) if t.device == device}
    return max(backend.foreign_bytes() - sum(t.untyped_storage().nbytes() for t in own.values()), 0)
