"""autotune's runner step against the bare loop an expert writes, same config, same device,
same batch (issue 46): counted (ops dispatched, host syncs, graphs compiled after the
first step, peak bytes) and timed (the bare loop's step time over the runner's: target
>= 0.98, the runner costing at most 2% over the bare loop).

Two levels, each with the arm that trains that way by hand: eager, and the model with its
loss compiled as one graph (``compile_model``; by hand, ``torch.compile`` of a function
that calls the model and returns its loss). The model is the issue's: a Hugging Face
GPT-2 of 4 layers, width 256, a vocabulary of 8,192, fp32, fused AdamW, 2 micro-batches
of 8 rows of 128 tokens. Timed by the harness every arm shares (benchmarks/harness.py),
the two arms in turn, several rounds, so that a slow spell hits both.

    python benchmarks/runner_step.py --out benchmarks/results/runner-step-cpu.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see run.py)

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from counted_ops import SYNCS, CountedOps  # tests/, on the path through benchmarks/

import autotune
from autotune.device import backend_for
from autotune.measure._tracker import CompiledBytesTracker, state_tensors
from benchmarks.harness import time_steps
from benchmarks.report import write_results

MICRO, ACCUM, SEQ, VOCAB = 8, 2, 128, 8192


def gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _loss(model: nn.Module, chunk: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**chunk).loss


def bare(compiled: bool, batch: dict[str, torch.Tensor]) -> tuple[Callable[[], None], list[Any]]:
    """The expert's loop: a loss per micro-batch over the accumulation, one fused AdamW
    step, the gradients freed; its step and the state its peak is counted beside."""
    model = gpt2()
    # Named, as an expert names it once the graph break shows: without a loss type
    # Hugging Face's loss warns through a logger dynamo cannot trace, which splits the graph
    # between the logits and the loss (the runner steps over that warning itself).
    model.loss_type = "ForCausalLM"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    loss = torch.compile(_loss, dynamic=False) if compiled else _loss
    chunks = [
        {k: v[i : i + MICRO] for k, v in batch.items()}
        for i in range(0, len(batch["input_ids"]), MICRO)
    ]

    def step() -> None:
        for chunk in chunks:
            (loss(model, chunk) / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, [model, optimizer]


def runner(compiled: bool, batch: dict[str, torch.Tensor]) -> tuple[Callable[[], None], list[Any]]:
    """The same config through autotune's runner."""
    config = autotune.TrainConfig(
        micro_batch_size=MICRO,
        grad_accum_steps=ACCUM,
        optimizer="adamw_fused",
        compile_model=compiled,
    )
    run = autotune.prepare(gpt2(), config, lr=1e-5, device="cpu")
    return (lambda: run.step(batch)), [run.model, run.optimizer]


def measure(
    arm: Callable[..., Any], compiled: bool, batch: dict[str, torch.Tensor]
) -> dict[str, Any]:
    step, state = arm(compiled, batch)
    step()  # compiled here
    graphs = counters["stats"]["unique_graphs"]
    with CountedOps() as ops, CountedOps(SYNCS.__contains__) as syncs:
        step()
    tracker = CompiledBytesTracker("cpu")
    tracker.track(state_tensors(*state))
    with tracker:
        step()
    return {
        "step": step,
        "ops": ops.count,
        "syncs": syncs.count,
        "graphs_after_first_step": counters["stats"]["unique_graphs"] - graphs,
        "peak_bytes": tracker.peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runner-step.json"))
    args = parser.parse_args()
    device = torch.device("cpu")
    ids = torch.randint(VOCAB, (MICRO * ACCUM, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    for compiled in (False, True):
        arms = {"bare": measure(bare, compiled, batch), "runner": measure(runner, compiled, batch)}
        ratios = []
        for _ in range(args.rounds):  # in turn, so that a slow spell hits both arms
            seconds = {n: time_steps(a["step"], device, warmup=1).step_s for n, a in arms.items()}
            ratios.append(seconds["bare"] / seconds["runner"])
        row = {
            "level": "model compiled" if compiled else "eager",
            "bare_over_runner_median": statistics.median(ratios),
            "bare_over_runner_min": min(ratios),
            "bare_over_runner_max": max(ratios),
            **{f"{n}_{k}": v for n, a in arms.items() for k, v in a.items() if k != "step"},
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_results(args.out, rows, device=backend_for(device).name())


if __name__ == "__main__":
    main()
