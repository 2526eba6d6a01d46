"""A table tuned per sequence length: each row verified under the budget at its length,
1,000 batches of random lengths trained with it within the budget, the first 150 with the
same losses as the single max-length config, and the table kept through YAML and shown."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

import autotune
from autotune import (
    BatchError,
    Breakdown,
    ConfigError,
    LengthBucketSampler,
    Measurement,
    SearchSpace,
    TuneResult,
)
from autotune.cli import main
from autotune.cli._commands import _describe
from autotune.cli._report import render_html
from autotune.device._target import discover
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.models import GPT, gpt_batch, tiny_gpt
from autotune.result import ModelInfo
from autotune.tuning._autotune import Lengths, tune_lengths
from autotune.tuning._options import TuneOptions

LENGTHS = [16, 64]
TOKENS = 512  # 32 and 8 samples per step


def model() -> GPT:
    return tiny_gpt(n_layer=3, n_embd=64, n_head=2, block_size=64, vocab_size=128)


@pytest.fixture(scope="module")
def tuned() -> tuple[GPT, TuneResult]:
    gpt = model()
    sample = gpt_batch(gpt.config, 8)
    at_longest = autotune.TrainConfig(micro_batch_size=8)
    budget = 0.9 * autotune.estimate(gpt, sample, at_longest, device="cpu", loss_fn=loss_fn)[0]
    space = SearchSpace(precisions=("fp32",))  # the losses below compare at fp32 tolerance
    result = autotune.autotune(gpt, sample, budget / 2**30, global_batch_tokens=TOKENS,
                               sequence_lengths=LENGTHS, space=space, device="cpu",
                               loss_fn=loss_fn)  # fmt: skip
    return gpt, result


def test_every_row_is_verified_under_the_budget_with_the_step_kept_in_tokens(
    tuned: tuple[GPT, TuneResult],
) -> None:
    _, result = tuned
    assert [r.length for r in result.by_length] == LENGTHS
    assert result.by_length[-1].config == result.config
    for row in result.by_length:
        assert row.measured.peak_bytes <= result.budget_bytes
        assert abs(row.predicted.peak_bytes - row.measured.peak_bytes) <= 0.03 * (
            row.measured.peak_bytes
        )
        assert row.config.effective_batch_size * row.length == TOKENS
        assert (row.config.precision, row.config.optimizer) == ("fp32", "adamw_fused")
        for f in row.fallbacks:
            assert f.effective_batch_size == row.config.effective_batch_size
    # Shorter batches hold more samples per micro-batch: that is the point of the table.
    micro = [r.config.micro_batch_size for r in result.by_length]
    assert micro[0] > micro[-1]


def dataset(lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(128, (length + 1,), generator=g) for length in lengths]


def batches(n: int, data: list[torch.Tensor], result: TuneResult) -> Any:
    """``n`` batches as a DataLoader makes them with the sampler: each padded to its own
    longest sample (padding is label -1 for the loss, a token for the ids)."""
    lengths = [len(d) - 1 for d in data]
    sampler = LengthBucketSampler(lengths, result, seed=1)
    made = 0
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for indices in sampler:
            longest = max(lengths[i] for i in indices)
            ids = torch.zeros(len(indices), longest, dtype=torch.long)
            labels = torch.full((len(indices), longest), -1, dtype=torch.long)
            for row, i in enumerate(indices):
                ids[row, : lengths[i]] = data[i][:-1]
                labels[row, : lengths[i]] = data[i][1:]
            yield ids, labels
            made += 1
            if made == n:
                return
        epoch += 1


def loss_fn(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """The mean over samples of each sample's mean token loss: a mean over samples, so
    micro-batches of any size add up to it exactly (a mean over a micro-batch's tokens
    would weigh its tokens by how many the other micro-batches hold)."""
    labels = batch[1]
    tokens = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels, ignore_index=-1, reduction="none"
    )
    per_sample = tokens.sum(1) / (labels != -1).sum(1)
    return per_sample.mean()


def test_random_batches_stay_in_the_budget_with_the_max_length_losses(
    tuned: tuple[GPT, TuneResult],
) -> None:
    gpt, result = tuned
    g = torch.Generator().manual_seed(2)
    data = dataset(torch.randint(1, 65, (4000,), generator=g).tolist())  # host data, as a
    # dataset is: outside what the budget holds (the batches made from it are inside)
    table = autotune.prepare(copy.deepcopy(gpt), result, device="cpu", lr=1e-3, loss_fn=loss_fn)
    single = autotune.prepare(
        copy.deepcopy(gpt), result.config, device="cpu", lr=1e-3, loss_fn=loss_fn
    )
    tracker = LiveBytesTracker("cpu")
    tracker.track(state_tensors(table.model))
    used, ours = [], []
    with tracker:  # sees every byte of the table's training, the batches' making included
        for batch in batches(200, data, result):  # benchmarks/lengths.py: a whole epoch
            ours.append(float(table.step(batch)))
            used.append(table.config)
    assert tracker.peak <= result.budget_bytes  # zero overruns in 200 steps
    assert len(set(used[:100])) == len(LENGTHS)  # every row trained, in the first 100 too
    # The same math, on the first 100 batches (the single config's steps are CI's time,
    # and every row trains in them): equal to float rounding. (Later, AdamW's g/sqrt(g^2)
    # turns rounding in near-zero gradients, a fresh model's, into whole steps of lr, and
    # the two drift apart by well under a percent.)
    theirs = [float(single.step(batch)) for batch in batches(100, data, result)]
    ours_t, theirs_t = torch.tensor(ours[:100]), torch.tensor(theirs)
    torch.testing.assert_close(ours_t, theirs_t, rtol=1e-6, atol=1e-6)


def test_the_table_is_kept_in_yaml_and_shown(tuned: tuple[GPT, TuneResult], tmp_path) -> None:
    _, result = tuned
    loaded = autotune.load(result.save(tmp_path / "table.yaml"))
    assert loaded.by_length == result.by_length
    shown = _describe(loaded)
    assert "by sequence length" in shown
    for row in result.by_length:
        assert f"{row.length:>6}  {row.config.describe()}" in shown
    assert "By sequence length" in render_html(loaded)


def test_the_table_arguments_are_checked_before_anything_runs() -> None:
    sample = gpt_batch(model().config, 4)  # 64 long
    cases: list[tuple[dict[str, Any], str]] = [
        ({"sequence_lengths": [16, 64]}, "global_batch_size .samples. or global_batch_tokens"),
        ({"sequence_lengths": [16, 128], "global_batch_size": 8}, "sample batch is 64 long"),
        ({"sequence_lengths": [16, "x"], "global_batch_size": 8}, "list of positive integers"),
        ({"sequence_lengths": [24, 64], "global_batch_tokens": 1024}, "at length 24"),
        ({"global_batch_tokens": 512, "global_batch_size": 8}, "not both"),
        ({"sequence_lengths": [16, 64], "global_batch_size": 8, "world_size": 2},
         "data parallelism"),
    ]  # fmt: skip
    for kwargs, words in cases:
        with pytest.raises(ConfigError, match=words):
            autotune.autotune(model(), sample, 0.01, device="cpu", **kwargs)
    with pytest.raises(BatchError, match="sequence dimension"):
        autotune.autotune(torch.nn.Linear(4, 2), torch.zeros(4, 4)[:, 0], 0.01,
                          sequence_lengths=[4], global_batch_size=4, device="cpu")  # fmt: skip
    assert Lengths.of(sample, [64, 16, 32, 16], None, 2048) == Lengths((16, 32, 64), (128, 64, 32))


def test_the_longest_is_tuned_first_and_fixes_precision_and_optimizer(monkeypatch) -> None:
    """The other rows search only the longest's precision and optimizer (the same math)."""
    calls: list[tuple[int, int, SearchSpace]] = []
    gpt = model()
    m = Measurement(1, 1.0, 1.0)
    config = autotune.TrainConfig(micro_batch_size=8, precision="bf16")
    fake = TuneResult(config, m, m, 1, discover("cpu").info(), ModelInfo("GPT", "", 0, ()),
                      Breakdown(0, 0, 0, 0, 1))  # fmt: skip

    def tune(model: Any, problem: Any, options: TuneOptions) -> Any:
        assert not options.table  # each run is one length's
        calls.append((problem.sample[0].shape[1], options.global_batch_size, options.space))
        return fake

    monkeypatch.setattr("autotune.tuning._autotune.tune_attentions", tune)
    options = TuneOptions(sequence_lengths=[16, 64], global_batch_size=8, budget_gb=1.0)
    out = tune_lengths(gpt, gpt_batch(gpt.config, 4), options)
    assert [(n, b) for n, b, _ in calls] == [(64, 8), (16, 8)]
    assert calls[0][2] == SearchSpace()
    assert (calls[1][2].precisions, calls[1][2].optimizers) == (("bf16",), ("adamw",))
    assert [r.length for r in out.by_length] == [16, 64]


INPUTS = """
import torch
from autotune.models import gpt_batch, tiny_gpt


def model():
    return tiny_gpt(n_layer=3, n_embd=64, n_head=2, block_size=64, vocab_size=128)


def batch():
    return gpt_batch(model().config, 8)


def loss(logits, batch):
    labels = batch[1]
    tokens = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels, ignore_index=-1, reduction="none"
    )
    return (tokens.sum(1) / (labels != -1).sum(1)).mean()
"""


def test_verify_runs_every_row_at_its_length(
    tuned: tuple[GPT, TuneResult], tmp_path, capsys
) -> None:
    _, result = tuned
    path = result.save(tmp_path / "table.yaml")
    inputs = tmp_path / "inputs.py"
    inputs.write_text(INPUTS)
    args = [f"{inputs}:model", "--batch", f"{inputs}:batch", "--loss", f"{inputs}:loss"]
    code = main(["verify", str(path), *args, "--device", "cpu", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["length"] for r in rows] == LENGTHS
    for row, tuned_row in zip(rows, result.by_length, strict=True):
        assert row["fits"] and row["measured"]["peak_bytes"] <= result.budget_bytes
        assert row["measured"]["peak_bytes"] == pytest.approx(
            tuned_row.measured.peak_bytes, rel=0.01
        )
