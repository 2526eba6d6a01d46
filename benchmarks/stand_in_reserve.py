"""What the caching allocator reserves beyond the live bytes: predicted against the CPU
stand-in of the allocator (tests/simulated_cuda.py), over sizes the profile never ran.

The profile runs at micro-batches 2 and 4; this checks its fitted lines at 1 to 64, kept,
half and fully checkpointed, fp32 and bf16. The stand-in is a model of the allocator's
statistics, not the allocator: the figure says the fit extrapolates sanely, not what a
GPU does (``benchmarks/calibrate.py`` measures that).

    python benchmarks/stand_in_reserve.py --out /tmp/reserve.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from simulated_cuda import SimulatedAllocator, SimulatedCuda

from autotune.config import TrainConfig
from autotune.cost._memory_model import MemoryModel
from autotune.device import _backend
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.models import gpt_batch, tiny_gpt
from autotune.verify._verifier import Verifier

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    allocator = SimulatedAllocator(total=8 * 2**30)
    _backend._BACKENDS["cpu"] = functools.partial(SimulatedCuda, allocator=allocator)
    rows = []
    with allocator:
        model = tiny_gpt(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=256)
        blocks = tuple(f"blocks.{i}" for i in range(4))
        sample = gpt_batch(model.config, 4)
        foreign = allocator.reserved  # the user's model, as the tuner leaves it out
        profiler = Profiler(
            copy.deepcopy(model), sample, blocks, device=CPU, loss_fn=None, foreign_bytes=foreign
        )
        profile, _ = memory_profile(
            profiler, ("fp32", "bf16"), ("adamw",), device_name="stand-in", context_bytes=0
        )
        del profiler
        memory = MemoryModel(profile)
        verifier = Verifier(
            copy.deepcopy(model),
            sample,
            device=CPU,
            budget_bytes=4 * 2**30,
            loss_fn=None,
            foreign_bytes=foreign,
        )
        for precision in ("fp32", "bf16"):
            for checkpoint in ((), blocks[:2], blocks):
                for b in (1, 4, 8, 16, 32, 64):
                    for accum in (1, 2):
                        config = TrainConfig(
                            micro_batch_size=b,
                            grad_accum_steps=accum,
                            precision=precision,
                            checkpoint=checkpoint,
                        )
                        predicted = memory.memory(config)[0]
                        measured, error = verifier.run(config)
                        assert measured is not None, error
                        err = (predicted - measured.peak_bytes) / measured.peak_bytes
                        rows.append({"config": config.describe(), "error": err})
                        print(f"{config.describe():60s} {err:+.3f}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    summary = {"median": statistics.median(errors), "max": max(errors), "rows": rows}
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"median {summary['median']:.3f}  max {summary['max']:.3f}")


if __name__ == "__main__":
    main()
