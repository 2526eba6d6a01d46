"""Variable-length data (issue 15): a table per sequence length with bucketed batches,
against one config tuned at the longest length with every batch padded to it.

    python benchmarks/lengths.py --out benchmarks/results/lengths-cpu.json   # ~6 min, 2 cores

A corpus of log-normal lengths between 32 and 1024 tokens (median about 200), a GPT of
1024 positions, a budget where the longest batches need a small micro-batch, the same
global batch (32 samples per step) and loss for both. The table's batches come from
``LengthBucketSampler``, each padded to its own longest sample; the baseline's are the
same samples in random batches of 32, padded to 1024. Both train the same samples once;
throughput counts the real (unpadded) tokens. Then the table's run is repeated under the
live-bytes tracker, step by step, to count budget overruns. Targets: tokens/s >= 1.5x the
baseline's, zero overruns.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import autotune
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.models import tiny_gpt

SHAPE = {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 1024, "vocab_size": 2048}
LENGTHS = [64, 128, 256, 512, 1024]
GLOBAL_BATCH = 32
SAMPLES = 640


def loss_fn(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """The mean over samples of each sample's mean token loss (padding is label -1)."""
    labels = batch[1]
    tokens = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), labels, ignore_index=-1, reduction="none"
    )
    return (tokens.sum(1) / (labels != -1).sum(1)).mean()


def corpus(n: int, seed: int = 0) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` samples of log-normal length in [32, 1024] (median about 200)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 0.8 + math.log(200))
    lengths = raw.clamp(32, 1024).round().int().tolist()
    data = [torch.randint(SHAPE["vocab_size"], (k + 1,), generator=g) for k in lengths]
    return lengths, data


def padded(indices: Sequence[int], data: list[torch.Tensor], to: int | None = None) -> Any:
    """The samples as (ids, labels), padded to ``to`` or to their longest."""
    longest = to or max(len(data[i]) - 1 for i in indices)
    ids = torch.zeros(len(indices), longest, dtype=torch.long)
    labels = torch.full((len(indices), longest), -1, dtype=torch.long)
    for row, i in enumerate(indices):
        n = len(data[i]) - 1
        ids[row, :n], labels[row, :n] = data[i][:-1], data[i][1:]
    return ids, labels


def train(runner: autotune.Runner, batches: Iterator[Any]) -> tuple[float, int, int]:
    """(seconds, steps, real tokens) of training ``batches``."""
    steps = tokens = 0
    started = time.perf_counter()
    for batch in batches:
        runner.step(batch)
        steps += 1
        tokens += int((batch[1] != -1).sum())
    return time.perf_counter() - started, steps, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lengths-cpu.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_gpt(**SHAPE)
    lengths, data = corpus(SAMPLES)
    sample = padded(range(8), [torch.randint(2048, (1025,)) for _ in range(8)])
    at_longest = autotune.TrainConfig(micro_batch_size=8)
    budget = 0.6 * autotune.estimate(model, sample, at_longest, device="cpu", loss_fn=loss_fn)[0]
    common = {"loss_fn": loss_fn, "global_batch_size": GLOBAL_BATCH, "device": "cpu"}
    t0 = time.perf_counter()
    single = autotune.autotune(model, sample, budget / 2**30, **common)
    single_s = time.perf_counter() - t0
    table = autotune.autotune(model, sample, budget / 2**30, sequence_lengths=LENGTHS, **common)
    print(f"single: {single.config.describe()} ({single_s:.0f} s)")
    for r in table.by_length:
        print(f"  {r.length:>5}: {r.config.describe()}, {r.measured.samples_per_s:.1f} samples/s")
    print(f"table tuned in {table.tuning_s:.0f} s")

    sampler = autotune.LengthBucketSampler(lengths, table, seed=1)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1)).tolist()
    plain = [order[i : i + GLOBAL_BATCH] for i in range(0, SAMPLES, GLOBAL_BATCH)]
    runs = {}
    for name, result, batches in (
        ("table", table, lambda: (padded(b, data) for b in sampler)),
        ("padded to 1024", single, lambda: (padded(b, data, 1024) for b in plain)),
    ):
        runner = autotune.prepare(copy.deepcopy(model), result, device="cpu", loss_fn=loss_fn)
        runner.step(padded(plain[0], data))  # the optimizer state exists, as in a long run
        seconds, steps, tokens = train(runner, batches())
        runs[name] = {"seconds": seconds, "steps": steps, "tokens": tokens,
                      "tokens_per_s": tokens / seconds}  # fmt: skip
        print(f"{name}: {steps} steps, {tokens} tokens in {seconds:.1f} s, "
              f"{tokens / seconds:.0f} tokens/s")  # fmt: skip
    speedup = runs["table"]["tokens_per_s"] / runs["padded to 1024"]["tokens_per_s"]
    overruns, worst = 0, 0
    runner = autotune.prepare(copy.deepcopy(model), table, device="cpu", loss_fn=loss_fn)
    for indices in sampler:
        batch = padded(indices, data)
        existing = state_tensors(runner.model, runner.optimizer)
        with measure_peak(torch.device("cpu"), existing=existing) as reading:
            runner.step(batch)
        worst = max(worst, reading.peak_bytes)
        overruns += reading.peak_bytes > table.budget_bytes
    print(f"table / padded: {speedup:.2f}x (target >= 1.5x); overruns {overruns} "
          f"(target 0), worst peak {worst / 2**20:.2f} of {table.budget_bytes / 2**20:.2f} MiB")  # fmt: skip
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/lengths.py --out benchmarks/results/lengths-cpu.json",
        "single": {"config": single.config.describe(), "tuning_s": single_s},
        "table": [
            {
                "length": r.length,
                "config": r.config.describe(),
                "samples_per_s": r.measured.samples_per_s,
                "peak": r.measured.peak_bytes,
            }
            for r in table.by_length
        ],
        "table_tuning_s": table.tuning_s,
        "budget": table.budget_bytes,
        "runs": runs,
        "speedup": speedup,
        "overruns": overruns,
        "worst_peak": worst,
        "lengths": {"median": sorted(lengths)[len(lengths) // 2], "mean": sum(lengths) / SAMPLES},
    }
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
