"""``LengthBucketSampler``: batches of similar lengths, each the size its row of a result
tuned per sequence length (``TuneResult.by_length``) trains in one optimizer step.

A sample belongs to the shortest row whose length holds it; a batch takes samples of one
row only, so that, padded to its own longest sample (or to the row's length), it trains
with that row's config. The order is random within a row and across batches, seeded, a
new one per epoch (:meth:`LengthBucketSampler.set_epoch`, as ``DistributedSampler``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from autotune._spelling import option
from autotune.errors import BatchError, ConfigError
from autotune.result import TuneResult
from autotune.train._lengths import row_index

__all__ = ["LengthBucketSampler"]


class LengthBucketSampler(Sampler[list[int]]):
    """A ``batch_sampler`` for a ``DataLoader`` over a dataset of varying lengths.

    Args:
        lengths: Each sample's length, in dataset order.
        result: A result tuned with ``sequence_lengths=`` (its ``by_length`` rows).
        shuffle: Shuffle within each row and the order of the batches.
        seed: Seed of the shuffle (with the epoch).
        drop_last: Drop each row's last batch when it is short (kept by default: a
            smaller batch trains within the same budget, its loss weighted exactly).

    Raises:
        ConfigError: ``result`` has no rows per length.
        BatchError: a sample is longer than the longest row.

    >>> loader = DataLoader(dataset, batch_sampler=LengthBucketSampler(lengths, result),
    ...                     collate_fn=pad_to_longest)
    """

    def __init__(
        self,
        lengths: Sequence[int],
        result: TuneResult,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(result, TuneResult) or not result.by_length:
            raise ConfigError(
                "LengthBucketSampler needs a result tuned per sequence length: call "
                f"autotune.autotune(..., {option('sequence_lengths')}=[...])."
            )
        self.rows = result.by_length
        self.batch_sizes = tuple(r.config.effective_batch_size for r in self.rows)
        limits = [r.length for r in self.rows]
        self.buckets: list[list[int]] = [[] for _ in self.rows]
        longer = [i for i, n in enumerate(lengths) if n > limits[-1]]
        if longer:
            raise BatchError(
                f"{len(longer)} samples (the first: index {longer[0]}, length "
                f"{lengths[longer[0]]}) are longer than the longest row ({limits[-1]}): cut "
                f"or drop them, or tune again with longer {option('sequence_lengths')}"
            )
        for i, n in enumerate(lengths):
            self.buckets[row_index(limits, n)].append(i)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently in each epoch (call before iterating)."""
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        out = []
        for bucket, size in zip(self.buckets, self.batch_sizes, strict=True):
            order = bucket
            if self.shuffle:
                order = [bucket[i] for i in torch.randperm(len(bucket), generator=g).tolist()]
            for start in range(0, len(order), size):
                batch = order[start : start + size]
                if len(batch) == size or not self.drop_last:
                    out.append(batch)
        if self.shuffle:
            out = [out[i] for i in torch.randperm(len(out), generator=g).tolist()]
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        full = (len(b) // s for b, s in zip(self.buckets, self.batch_sizes, strict=True))
        if self.drop_last:
            return sum(full)
        return sum(-(-len(b) // s) for b, s in zip(self.buckets, self.batch_sizes, strict=True))
