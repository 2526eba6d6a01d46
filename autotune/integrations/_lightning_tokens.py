"""Token-weighted accumulation in Lightning's loop.

Lightning divides each micro-batch's loss by ``accumulate_grad_batches``: every
micro-batch of a step weighs the same. Where the loss is a mean over label tokens (a
language model's), a micro-batch of short padded rows then counts each of its tokens more
than one batch of the step's rows would: what is learned depends on the micro-batch the
tuner chose. Here the train loader's batches are read a step's window ahead, on the host
where the loader makes them, and each batch's loss is weighed by its share of the
window's counted tokens (times the accumulation, which Lightning divides by), so that the
step's gradient is that of the mean over all its tokens, as Hugging Face's Trainer does
with ``num_items_in_batch``. The window follows Lightning's: ``accumulate_grad_batches``
batches from the start of each epoch, the last one shorter where the epoch ends first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import Any

import lightning.pytorch as pl

from autotune.integrations._lightning_tuning import step_loss
from autotune.train import counted_tokens

__all__ = ["TokenWindows", "weighed_step"]


class TokenWindows:
    """The train loader's batches, read a step's window ahead, each weighed by its share
    of the window's counted label tokens.

    Args:
        loader: The train loader (a DataLoader, or any sized iterable of batches).
        steps: Batches a step accumulates (``accumulate_grad_batches``).
        offset: Leading positions of each row's labels the loss never counts.
        limit: Batches the epoch runs (Lightning's ``num_training_batches``).
    """

    def __init__(self, loader: Any, steps: int, offset: int, limit: float) -> None:
        self.loader = loader
        self.steps = steps
        self.offset = offset
        self.limit = limit
        self.weights: dict[int, float] = {}
        """Each batch's weight, by its index in the epoch."""

    def __iter__(self) -> Iterator[Any]:
        return self.windowed(iter(self.loader))

    def windowed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, an epoch of the loader's, read a window ahead and weighed."""
        self.weights = {}
        start = 0
        while start < self.limit:
            window = list(islice(batches, int(min(self.steps, self.limit - start))))
            if not window:
                return
            # Where the loader makes them, on the host: read by Python, no device waits.
            counts: list[int] = [counted_tokens(b, self.offset).tolist() for b in window]  # type: ignore[misc]
            total = sum(counts) or 1.0  # no counted token: each loss is not finite anyway
            for i, count in enumerate(counts):
                self.weights[start + i] = self.steps * count / total
            yield from window
            start += len(window)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # the loader's sampler, dataset, batch_size
        if name == "loader":  # not set yet (a copy being made): no loader to ask
            raise AttributeError(name)
        return getattr(self.loader, name)

    def weight(self, batch_idx: int) -> float:
        """The weight of the epoch's batch ``batch_idx``: its share of its window's
        counted tokens, times the accumulation."""
        return self.weights[batch_idx]


def weighed_step(module: pl.LightningModule, windows: TokenWindows) -> Callable[..., Any]:
    """``module.training_step`` with its loss weighed by its batch's share of the step's
    counted tokens (:class:`TokenWindows`); a dict output's ``"loss"`` likewise."""
    step = module.training_step

    def training_step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        out: Any = step(batch, batch_idx, *args, **kwargs)
        if out is None:  # a batch the module skips
            return None
        weight = windows.weight(batch_idx)
        if isinstance(out, Mapping):
            return {**out, "loss": step_loss(out) * weight}
        return step_loss(out) * weight

    return training_step
