"""Switching an applied config mid-training, weights and optimizer state kept: the
fallback ladder (a step that runs out of device memory runs again on the next fallback,
with the same batch, random state and buffers), and the row of a table tuned per
sequence length that a batch trains with."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from autotune.config import TrainConfig
from autotune.device import Backend
from autotune.errors import AutotuneWarning, ConfigError
from autotune.train._attention import attention_of, set_attention
from autotune.train._checkpoint import (
    apply_checkpointing,
    apply_offloading,
    check_blocks,
    remove_checkpointing,
)
from autotune.train._compiled import compile_blocks, is_compiled, uncompile_blocks
from autotune.train._steps import make_scaler

if TYPE_CHECKING:
    from autotune.train._applied import Applied

__all__ = ["run", "select", "snapshot", "switch", "wrap"]

T = TypeVar("T")


def run(applied: Applied, step: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``step(*args, **kwargs)``, one optimizer step, run again on a fallback after an
    out-of-memory error.

    When ``step`` raises ``torch.OutOfMemoryError`` before the optimizer step began, with
    fallbacks left, the partial step is freed, the random state and the buffers are put
    back, the next fallback takes over (with a warning) and ``step`` runs again with the
    same arguments: ``applied.micro_batches`` then splits the same batch as the fallback
    says. Without fallbacks it is just a call.
    """
    # With a table, the step may move to a row with fallbacks: snapshot if any row has.
    rows = (applied.fallbacks, *(r.fallbacks for r in applied.rows))
    while True:
        restore = snapshot(applied.model, applied.backend) if any(rows) else None
        applied.stepping = False
        try:
            return step(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if restore is None or applied.stepping or not applied.fallbacks:
                # No fallback left, or weights already half-updated: not retried. The
                # partial gradients go, so that a caller who retries starts clean.
                applied.zero_grad()
                raise
            reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
        # Outside the except block, so that the traceback no longer pins the step's tensors.
        applied.parallel.reset()
        applied.zero_grad()
        restore()
        previous = applied.config
        switch(applied, applied.fallbacks.pop(0))
        if applied.row is not None:  # the row trains with its fallback from now on
            applied.row.config = applied.config
        warnings.warn(
            f"out of memory with {previous.describe()} ({reason}); the same batch runs "
            f"again with fallback {applied.config.describe()}.",
            AutotuneWarning,
            stacklevel=4,
        )


def switch(applied: Applied, config: TrainConfig) -> None:
    """``applied`` trains with ``config`` from the next step on, keeping weights and
    optimizer state.

    Raises:
        ConfigError: ``config`` names another optimizer (its state could not be kept).
    """
    if config.optimizer != applied.config.optimizer:
        raise ConfigError(
            f"cannot switch from optimizer {applied.config.optimizer} to {config.optimizer} "
            "mid-training; apply the new config to the model instead."
        )
    check_blocks(applied.model, config)
    applied.parallel.switch(config)
    wrap(applied, config)
    if config.offload_optimizer != applied.config.offload_optimizer:
        applied.rebuild_optimizer(config.offload_optimizer)
    applied.scaler = make_scaler(config, applied.device, applied.scaler)
    applied.config = config


def wrap(applied: Applied, config: TrainConfig) -> None:
    """The model-side knobs of ``config`` on ``applied.model``: its blocks compiled, then
    checkpointed (fully or selectively) and offloaded, its attention implementation (put
    back by ``applied.undo()``)."""
    model = applied.model
    if config.attention is not None and config.attention != attention_of(model):
        put_back = set_attention(model, config.attention)  # first: it may refuse
        if applied.attention_put_back is None:  # the model's own comes back at undo
            applied.attention_put_back = put_back
            applied.on_undo(put_back)
    remove_checkpointing(model)
    compiled = {n for n, m in model.named_modules() if is_compiled(m)}
    if compiled != set(config.compile_blocks):  # the compiled code is cached: no recompile
        uncompile_blocks(model)
        compile_blocks(model, config.compile_blocks)
    apply_checkpointing(model, config.checkpoint)
    apply_checkpointing(model, config.selective_checkpoint, selective=True)
    apply_offloading(model, config.offload_activations, applied.offloader)


def select(applied: Applied, batch: Any) -> None:
    """With a table tuned per sequence length, ``applied`` trains with the row of
    ``batch``'s (padded) length from now on: its config, its fallbacks. Without a table,
    nothing.

    Raises:
        BatchError: ``batch`` is longer than the table's longest length.
    """
    row = applied.rows.of_batch(batch)
    if row is not None and row is not applied.row:
        if row.config != applied.config:
            switch(applied, row.config)
        applied.row, applied.fallbacks = row, row.fallbacks


def snapshot(model: nn.Module, backend: Backend) -> Callable[[], None]:
    """A function that puts the random state and ``model``'s buffers back as they are now."""
    cpu_rng = torch.random.get_rng_state()
    device_rng = backend.rng_state()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def restore() -> None:
        torch.random.set_rng_state(cpu_rng)
        if device_rng is not None:
            backend.set_rng_state(device_rng)
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        backend.empty_cache()

    return restore
