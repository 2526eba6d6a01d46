"""Batches of varying length: their length, the row of a table each trains with (its own
config and fallbacks, the optimizer state kept), and the sampler that makes them."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch
from test_fallback import result_for
from torch import nn

import autotune
from autotune import BatchError, ConfigError, LengthBucketSampler, TrainConfig
from autotune.models import tiny_gpt
from autotune.result import LengthRow, Measurement, TuneResult
from autotune.train._lengths import row_index, sequence_length, truncate

M = Measurement(1, 1.0, 1.0)


def test_a_batch_length_is_dimension_1_of_its_first_tensor_that_has_one() -> None:
    ids = torch.zeros(4, 12, dtype=torch.long)
    assert sequence_length(ids) == 12
    assert sequence_length((torch.zeros(4), ids)) == 12
    assert sequence_length({"input_ids": ids, "attention_mask": ids}) == 12
    with pytest.raises(BatchError, match="sequence dimension"):
        sequence_length((torch.zeros(4), torch.zeros(4)))


def test_a_sample_is_cut_where_it_is_as_long_as_the_batch() -> None:
    batch = {"input_ids": torch.arange(24).view(2, 12), "pixel": torch.zeros(2, 5, 3)}
    cut = truncate(batch, 4)
    assert cut["input_ids"].tolist() == [[0, 1, 2, 3], [12, 13, 14, 15]]
    assert cut["input_ids"].is_contiguous()  # a model may view(-1) its labels
    assert cut["pixel"].shape == (2, 5, 3)  # another dimension 1: not the sequence
    with pytest.raises(BatchError):
        truncate(batch, 13)


def test_a_length_goes_to_the_shortest_row_that_holds_it() -> None:
    assert [row_index([16, 32, 64], n) for n in (1, 16, 17, 64)] == [0, 0, 1, 2]
    with pytest.raises(BatchError, match=r"longer than the longest .* \(64\)"):
        row_index([16, 32, 64], 65)


def table_result(model: nn.Module, rows: list[LengthRow]) -> TuneResult:
    """A result whose longest row is its config, and the table."""
    longest = result_for(model, rows[-1].config, *rows[-1].fallbacks)
    return dataclasses.replace(longest, by_length=tuple(rows))


def gpt_batch_of(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(64, (n, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_each_batch_trains_with_its_rows_config_and_fallbacks_keeping_the_optimizer() -> None:
    model = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=64)
    short = TrainConfig(micro_batch_size=8, grad_accum_steps=1)
    long = TrainConfig(micro_batch_size=8, grad_accum_steps=1, checkpoint=("blocks.1",))
    frugal = TrainConfig(micro_batch_size=2, grad_accum_steps=4, checkpoint=("blocks.0",))
    result = table_result(model, [LengthRow(16, short, M, M), LengthRow(32, long, M, M, (frugal,))])
    reference = tiny_gpt(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=64)

    def too_big(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if args[0].numel() > 128:  # the long row's micro-batch of 8 x 32 tokens
            raise torch.OutOfMemoryError("injected")

    model.register_forward_pre_hook(too_big)
    runner = autotune.prepare(model, result, device="cpu", lr=1e-3)
    plain = autotune.prepare(reference, short, device="cpu", lr=1e-3)
    optimizer = runner.optimizer
    seen = []
    for step, length in enumerate((16, 32, 8, 32, 16)):
        batch = gpt_batch_of(8, length, step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = runner.step(batch)
        seen.append((runner.config, [str(w.message)[:14] for w in caught]))
        torch.testing.assert_close(loss, plain.step(batch), rtol=1e-5, atol=1e-6)
    # The long row ran out of memory once and trains with its fallback from then on.
    assert seen == [(short, []), (frugal, ["out of memory "]), (short, []), (frugal, []),
                    (short, [])]  # fmt: skip
    assert runner.optimizer is optimizer  # one optimizer, its state kept through the switches
    assert all(s["step"] == 5 for s in optimizer.state.values())
    with pytest.raises(BatchError, match="longer than the longest"):
        runner.step(gpt_batch_of(8, 33, 0))
    assert runner.config == short  # nothing changed


def test_the_sampler_batches_each_row_at_its_own_size() -> None:
    model = nn.Linear(2, 2)
    rows = [LengthRow(8, TrainConfig(micro_batch_size=4), M, M),
            LengthRow(32, TrainConfig(micro_batch_size=2), M, M)]  # fmt: skip
    result = table_result(model, rows)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 33, (101,), generator=g).tolist()
    sampler = LengthBucketSampler(lengths, result, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(101))  # every sample once
    for b in batches:
        row = 0 if max(lengths[i] for i in b) <= 8 else 1
        assert all((lengths[i] <= 8) == (row == 0) for i in b)
        assert len(b) <= (4, 2)[row]
    sizes = collections.Counter(len(b) for b in batches)
    assert sizes[4] >= 1 and sizes[2] >= 1
    sampler.set_epoch(1)
    assert list(sampler) != batches  # another order in another epoch
    dropped = LengthBucketSampler(lengths, result, drop_last=True)
    assert len(list(dropped)) == len(dropped) and all(len(b) in (2, 4) for b in dropped)
    with pytest.raises(BatchError, match="longer than the longest row"):
        LengthBucketSampler([*lengths, 40], result)
    plain = dataclasses.replace(result, by_length=())
    with pytest.raises(ConfigError, match="sequence_lengths"):
        LengthBucketSampler(lengths, plain)
