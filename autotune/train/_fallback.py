"""The fallback ladder of a training handle: a step that runs out of device memory runs
again on the next fallback, with the same batch, random state and buffers; and the row of
a table tuned per sequence length that a batch trains with.

Putting the buffers back needs a copy of each one a step can change, held through every
step: only those (BatchNorm's running statistics, counters, a moving average), found
once by the tuner on its own training step (:func:`written_buffers`) and carried by the
result, so that the copy is small and its bytes are in the prediction. A read-only
buffer (a position table, a mask) is never copied.

:class:`Ladder` owns that state (the table's rows, the row in use, the fallbacks left, and
whether the optimizer step has begun). What it needs from the handle that owns it (the
model and backend to snapshot, freeing the gradients, resetting the data parallelism, and
switching to another config) comes through the :class:`Owner` protocol, the handle being
passed to each call (the ladder keeps no reference to it: no reference cycle keeps the
handle's model and optimizer alive); switching a config itself is the handle's
(``Applied.switch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from autotune.config import TrainConfig
from autotune.device import Backend
from autotune.errors import warn
from autotune.result import LengthRow
from autotune.train._lengths import Row, Rows

__all__ = ["Ladder", "Owner", "snapshot", "tracks_statistics", "written_buffers"]

T = TypeVar("T")


class Resets(Protocol):
    """The data parallelism, as the ladder sees it."""

    def reset(self) -> None:
        """Put the per-step state back after an error in the middle of a step."""


class Owner(Protocol):
    """What a :class:`Ladder` needs from the handle that trains with it."""

    @property
    def model(self) -> nn.Module:
        """The model, whose buffers a snapshot keeps."""

    @property
    def backend(self) -> Backend:
        """The device's backend, whose random state a snapshot keeps."""

    @property
    def config(self) -> TrainConfig:
        """The configuration in use."""

    @property
    def parallel(self) -> Resets:
        """The data parallelism, reset after a failed step."""

    def zero_grad(self) -> None:
        """Free every gradient."""

    def switch(self, config: TrainConfig) -> None:
        """Train with ``config`` from the next step on, weights and optimizer state kept."""


class Ladder:
    """The fallback ladder of a handle (an :class:`Owner`, passed to each call): the
    fallbacks left of the config in use, and with a table tuned per sequence length, its
    rows and the row in use.

    Args:
        config: The configuration the handle starts with.
        fallbacks: Configurations to fall back to, fastest first (without a table).
        table: A table tuned per sequence length (empty: none).
        written: The buffers a training step writes, which a snapshot copies (``None``:
            not known, every buffer).
    """

    def __init__(
        self,
        config: TrainConfig,
        fallbacks: Sequence[TrainConfig] = (),
        table: Sequence[LengthRow] = (),
        written: Sequence[str] | None = None,
    ) -> None:
        self.rows = Rows.of(table, config)
        """A table tuned per sequence length: each batch trains with its length's row."""
        self.row: Row | None = self.rows.first(config)
        """The row in use (``None`` without a table)."""
        self.fallbacks = self.row.fallbacks if self.row else Rows.usable(fallbacks, config)
        """The current config's fallbacks still left (its row's, with a table)."""
        self.stepping = False
        """The optimizer step has begun: an out-of-memory error is no longer retried."""
        self.written = None if written is None else tuple(written)
        """The buffers a training step writes, which a snapshot copies (``None``: every one)."""

    def run(self, owner: Owner, step: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``step(*args, **kwargs)``, one optimizer step of ``owner``, run again on a
        fallback after an out-of-memory error.

        When ``step`` raises ``torch.OutOfMemoryError`` before the optimizer step began
        (:attr:`stepping`), with fallbacks left, the partial step is freed, the random
        state and the buffers are put back, the next fallback takes over (with a warning)
        and ``step`` runs again with the same arguments: the owner's micro-batches then
        split the same batch as the fallback says. Without fallbacks it is just a call.
        """
        # With a table, the step may move to a row with fallbacks: snapshot if any row has.
        rows = (self.fallbacks, *(r.fallbacks for r in self.rows))
        while True:
            restore = snapshot(owner.model, owner.backend, self.written) if any(rows) else None
            self.stepping = False
            try:
                return step(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                if restore is None or self.stepping or not self.fallbacks:
                    # No fallback left, or weights already half-updated: not retried. The
                    # partial gradients go, so that a caller who retries starts clean.
                    owner.zero_grad()
                    raise
                reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
            # Outside the except block, so that the traceback no longer pins the step's tensors.
            owner.parallel.reset()
            owner.zero_grad()
            restore()
            previous = owner.config
            owner.switch(self.fallbacks.pop(0))
            if self.row is not None:  # the row trains with its fallback from now on
                self.row.config = owner.config
            warn(
                f"out of memory with {previous.describe()} ({reason}); the same batch runs "
                f"again with fallback {owner.config.describe()}.",
            )

    def select(self, owner: Owner, batch: Any) -> None:
        """With a table tuned per sequence length, ``owner`` trains with the row of
        ``batch``'s (padded) length from now on: its config, its fallbacks. Without a
        table, nothing.

        Raises:
            BatchError: ``batch`` is longer than the table's longest length.
        """
        row = self.rows.of_batch(batch)
        if row is not None and row is not self.row:
            if row.config != owner.config:
                owner.switch(row.config)
            self.row, self.fallbacks = row, row.fallbacks


def snapshot(
    model: nn.Module, backend: Backend, written: Sequence[str] | None = None
) -> Callable[[], None]:
    """A function that puts the random state and ``model``'s buffers back as they are now.

    Args:
        model: The model whose buffers are kept.
        backend: Its device's backend, whose random state is kept.
        written: The qualified names of the buffers a training step writes
            (:func:`written_buffers`): only those are copied. ``None``, or a name the
            model does not have: every buffer (a result saved before the tuner recorded
            them, or used on another model).
    """
    cpu_rng = torch.random.get_rng_state()
    device_rng = backend.rng_state()
    named = dict(model.named_buffers())
    # A name the model does not have (another model than the one tuned): every buffer.
    names = named if written is None or not set(written) <= named.keys() else written
    saved = [(name, named[name].detach().clone()) for name in names]

    def restore() -> None:
        torch.random.set_rng_state(cpu_rng)
        if device_rng is not None:
            backend.set_rng_state(device_rng)
        with torch.no_grad():
            for name, value in saved:
                owner, _, key = name.rpartition(".")
                module = model.get_submodule(owner)
                live = module._buffers.get(key)
                if live is not None and live.shape == value.shape and live.dtype == value.dtype:
                    live.copy_(value)
                else:  # replaced in the step (``self.count = self.count + 1``): put back
                    module._buffers[key] = value
        backend.empty_cache()

    return restore


@contextlib.contextmanager
def written_buffers(model: nn.Module) -> Iterator[list[str]]:
    """The buffers of ``model`` that the training steps run inside the block write, by
    qualified name: a list, filled as the block ends.

    A buffer counts as written where it changed in place (its version moved), was
    replaced or made by a step, or belongs to a norm layer that tracks running statistics
    in training mode (its kernel writes them without moving a version).
    """
    before = {name: (id(b), _version(b)) for name, b in model.named_buffers()}
    out: list[str] = []
    yield out
    for owner_name, owner in model.named_modules():
        prefix = f"{owner_name}." if owner_name else ""
        stats = tracks_statistics(owner)
        for key, b in owner._buffers.items():
            name = f"{prefix}{key}"
            if b is not None and (stats or before.get(name) != (id(b), _version(b))):
                out.append(name)
    named = dict(model.named_buffers())  # a buffer two modules share is named once
    out[:] = [n for n in dict.fromkeys(out) if n in named]


def _version(b: torch.Tensor) -> int | None:
    """``b``'s in-place version (``None``: an inference tensor, which has none)."""
    return None if b.is_inference() else b._version


def tracks_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a norm layer updating running statistics in its forward
    (training mode, ``track_running_stats``)."""
    return module.training and getattr(module, "track_running_stats", False) is True
