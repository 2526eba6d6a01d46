"""Sequence lengths of batches: a batch's length, a sample cut to a shorter one, and the
row of a table of lengths that a batch trains with.

A batch's length is its padded length: dimension 1 of its first tensor with two or more
dimensions (``input_ids`` of a dict, the token ids of a tuple). Activation memory follows
the tensors' shapes, so the padded length, not the longest unpadded sequence, decides
what a step needs; a collator that pads each batch to its own longest sequence (as
Hugging Face's ``DataCollatorWithPadding`` does) makes the two the same.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from torch import Tensor

from autotune._spelling import option
from autotune.config import TrainConfig
from autotune.errors import BatchError
from autotune.result import LengthRow
from autotune.train import _batch as batching
from autotune.train._batch import Batch

__all__ = ["Row", "Rows", "row_index", "sequence_length", "truncate"]


def sequence_length(batch: Batch) -> int:
    """The padded length of ``batch``.

    Raises:
        BatchError: no tensor of ``batch`` has a second dimension.
    """
    found: list[int] = []

    def first(t: Tensor) -> Tensor:
        if not found:
            found.append(t.shape[1])
        return t

    batching.batch_size(batch)  # a clear BatchError for a batch that is not one
    batching.map_tensors(batch, first, min_ndim=2)
    if not found:
        raise BatchError(
            "the batch has no tensor with a sequence dimension (dimension 1), so its length "
            "is unknown: pass token ids shaped (batch, length), or leave "
            f"{option('sequence_lengths')} out"
        )
    return found[0]


def truncate(batch: Batch, length: int) -> Batch:
    """``batch`` cut to ``length`` along dimension 1 of every tensor as long as the batch:
    ids, masks and labels alike, contiguous (a model may ``view`` them); other tensors pass
    unchanged."""
    full = sequence_length(batch)
    if not 1 <= length <= full:
        raise BatchError(f"cannot cut a batch of length {full} to {length}")
    return batching.map_tensors(
        batch, lambda t: t[:, :length].contiguous() if t.shape[1] == full else t, min_ndim=2
    )


def row_index(lengths: Sequence[int], length: int) -> int:
    """The index of the shortest of the ascending ``lengths`` that holds ``length``.

    Raises:
        BatchError: ``length`` is longer than the longest.
    """
    i = bisect.bisect_left(lengths, length)
    if i == len(lengths):
        raise BatchError(
            f"a batch of length {length} is longer than the longest the config was tuned for "
            f"({lengths[-1]}): cut or split such sequences, or tune again with "
            f"{option('sequence_lengths')} up to {length}"
        )
    return i


@dataclasses.dataclass
class Row:
    """A row of a table tuned per sequence length, as training goes: its config (a
    fallback after an out-of-memory error) and the fallbacks left."""

    length: int
    config: TrainConfig
    fallbacks: list[TrainConfig]


class Rows(list[Row]):
    """The rows of a table, ascending in length (empty: no table)."""

    @staticmethod
    def of(table: Sequence[LengthRow], config: TrainConfig) -> Rows:
        """The rows of ``table``, keeping the fallbacks ``config`` can switch to."""
        return Rows(Row(r.length, r.config, Rows.usable(r.fallbacks, config)) for r in table)

    @staticmethod
    def usable(fallbacks: Sequence[TrainConfig], config: TrainConfig) -> list[TrainConfig]:
        """The ``fallbacks`` that training with ``config`` can switch to."""
        return [f for f in fallbacks if config.can_switch_to(f)]

    def first(self, config: TrainConfig) -> Row | None:
        """The row that trains with ``config`` (else the longest); ``None``: no table."""
        return next((r for r in self if r.config == config), self[-1]) if self else None

    def of_batch(self, batch: Batch) -> Row | None:
        """The row of ``batch``'s length; ``None``: no table.

        Raises:
            BatchError: ``batch`` is longer than the longest row.
        """
        if not self:
            return None
        return self[row_index([r.length for r in self], sequence_length(batch))]
