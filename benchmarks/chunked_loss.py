"""The chunked loss against the plain one (issue 46): what a forward and backward hold beyond
the weights, and the loss and gradients of each, on causal language models of a 32,000-word
vocabulary (a 2-layer LLaMA and GPT-2 of width 64, 4 x 64 tokens, fp32, a prompt's labels
left out). Counted, exactly, by the live-bytes tracker.

    python benchmarks/chunked_loss.py --out benchmarks/results/chunked-loss-cpu.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see run.py)

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
import benchmarks  # noqa: F401  (torchvision importable on a CPU torch, as for every benchmark)
from autotune.device import backend_for
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from benchmarks.report import write_results

VOCAB, SEQ, ROWS = 32_000, 64, 4


def models() -> dict[str, Callable[[], nn.Module]]:
    import transformers

    def llama() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
            use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    def gpt2() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)

    return {"llama": llama, "gpt2": gpt2}


def held(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> tuple[int, Any]:
    """Bytes a forward and backward held beyond the weights, and the loss."""
    tracker = LiveBytesTracker("cpu")
    tracker.track(state_tensors(model))
    with tracker:
        start = tracker.live
        loss = loss_of(model)
        loss.backward()
    return tracker.peak - start, loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("chunked-loss.json"))
    args = parser.parse_args()
    ids = torch.randint(VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :7] = -100
    batch = {"input_ids": ids, "labels": labels}
    rows = []
    for name, build in models().items():
        plain, chunked = build(), build()
        plain_bytes, plain_loss = held(plain, lambda m: m(**batch).loss)
        chunked_bytes, chunked_loss = held(chunked, lambda m: autotune.chunked_loss(m, batch))
        grads = max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(plain.parameters(), chunked.parameters(), strict=True)
        )
        row = {
            "model": name,
            "plain_held_bytes": plain_bytes,
            "chunked_held_bytes": chunked_bytes,
            "loss_difference": abs(plain_loss - chunked_loss).item(),
            "gradient_difference_max": grads,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_results(args.out, rows, device=backend_for(torch.device("cpu")).name())


if __name__ == "__main__":
    main()
