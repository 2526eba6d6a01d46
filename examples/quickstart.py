"""Tune a small GPT under a memory budget, print the winner and its YAML, train with it.

    python examples/quickstart.py                 # CPU: about half a minute on 2 cores
    python examples/quickstart.py --device cuda   # a GPU, with a larger budget

No downloads: the model is autotune's built-in GPT, the data random tokens.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

# torch's OpenMP threads wait passively: spinning, they take the cores that other work on
# a shared machine needs, and make every timing noise. Read when torch loads, so set first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

import autotune
from autotune.models import gpt_batch, tiny_gpt


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="default: 0.09 on CPU, 2 on CUDA"
    )
    parser.add_argument("--global-batch", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    on_gpu = args.device.startswith("cuda")
    budget = args.budget_gb or (2.0 if on_gpu else 0.09)

    model = tiny_gpt(n_layer=12, n_embd=768, n_head=12, block_size=512) if on_gpu else tiny_gpt()
    sample = gpt_batch(model.config, 8)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"tuning a {n_params / 1e6:.1f}M-parameter GPT on {args.device}, budget {budget} GiB, "
        f"global batch {args.global_batch}"
    )
    result = autotune.autotune(
        model, sample, budget_gb=budget, global_batch_size=args.global_batch, device=args.device
    )

    c, p, m = result.config, result.predicted, result.measured
    print(f"\nwinner: {c.describe()}  (tuned in {result.tuning_s:.1f} s)")
    print(
        f"  peak     predicted {mib(p.peak_bytes)}, measured {mib(m.peak_bytes)}, "
        f"budget {mib(result.budget_bytes)}"
    )
    print(f"  speed    predicted {p.samples_per_s:.0f}, measured {m.samples_per_s:.0f} samples/s")
    print(f"  noise    a timing is sure to about {100 * result.noise:.1f}% on this machine")
    expert = result.expert
    if expert is not None and expert.measured is not None:  # the hand config to beat
        ratio = m.samples_per_s / expert.measured.samples_per_s
        print(
            f"  expert   {expert.config.describe()}: measured "
            f"{expert.measured.samples_per_s:.0f} samples/s, this config {ratio:.2f}x"
        )
    for config in result.tied:
        print(f"  tied     {config.describe()} (as fast within that noise; the simpler won)")
    if result.busy:
        print(f"  busy     {result.busy}")
    for i, f in enumerate(result.fallbacks, 1):
        print(f"  fallback {i}: {f.describe()}")

    path = result.save(Path(tempfile.mkdtemp()) / "tuned.yaml")
    print(f"\n{path}:\n{path.read_text()}")

    runner = autotune.prepare(model, autotune.load(path), lr=3e-4)
    batch = gpt_batch(model.config, c.effective_batch_size, seed=1)
    losses = [runner.step(batch).item() for _ in range(3)]
    print("training with the tuned config, loss:", " -> ".join(f"{x:.3f}" for x in losses))


if __name__ == "__main__":
    main()
