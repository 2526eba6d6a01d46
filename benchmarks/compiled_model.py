"""The model compiled whole with its loss (``compile_model``): its peak predicted against
measured, and what the loss inside the graph holds against the eager loss (issue 46).

For a Hugging Face GPT-2 (4 layers, width 64, a vocabulary of 512, 32 tokens, with
dropout), fp32 and fused AdamW, global batch 16: ``autotune.estimate()`` of each config
against the peak the verifier measures for it (the runner, under the compiled tracker),
every block kept, every block checkpointed inside the graph, and one block of four; then
the same micro-batch eager, whose loss reads the logits op by op.

    python benchmarks/compiled_model.py --out benchmarks/results/compiled-model-cpu.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see run.py)

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
import benchmarks  # noqa: F401  (torchvision importable on a CPU torch, as for every benchmark)
from autotune import TrainConfig
from autotune.device import backend_for
from autotune.train._compiled import measured_compiling
from autotune.verify import Verifier
from benchmarks.report import write_results

GLOBAL, SEQ, VOCAB = 16, 32, 512


def gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("compiled-model.json"))
    args = parser.parse_args()
    device = torch.device("cpu")
    model = gpt2()
    ids = torch.randint(VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    blocks = autotune.find_blocks(model)
    base = TrainConfig(micro_batch_size=8, grad_accum_steps=2, optimizer="adamw_fused")
    configs = [
        base.replace(compile_model=True),
        base.replace(compile_model=True, checkpoint=blocks),
        base.replace(micro_batch_size=4, grad_accum_steps=4, compile_model=True),
        base.replace(
            micro_batch_size=4, grad_accum_steps=4, compile_model=True, checkpoint=blocks[:1]
        ),
        base,
    ]
    rows = []
    for config in configs:
        predicted = autotune.estimate(model, batch, config, device=device).peak_bytes
        verifier = Verifier(
            copy.deepcopy(model),
            batch,
            device=device,
            budget_bytes=2**34,
            loss_fn=None,
            blocks=blocks,
        )
        with measured_compiling():
            measured, error = verifier.trial(config)
        row = {
            "config": config.describe(),
            "predicted_peak": predicted,
            "measured_peak": measured.peak_bytes if measured else None,
            "error": (predicted / measured.peak_bytes - 1) if measured else error,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_results(args.out, rows, device=backend_for(device).name())


if __name__ == "__main__":
    main()
