"""What the caching allocator reserves beyond the live bytes, predicted two ways against
the CPU stand-in of the allocator (tests/simulated_cuda.py: every storage the CPU
allocates goes through the allocator's model, so its rules meet real request sequences),
over sizes the profile never ran (issue 48).

The profile runs at micro-batches 2 and 4; this checks the prediction at 1 to 64 (and
with 2 micro-batches a step), kept, half and fully checkpointed, fp32 and bf16:
``fitted``, the line fitted over the profiled sizes (what stands where no requests were
recorded); ``replayed``, the allocator's model fed the profiled step's requests at the
config's size. The stand-in is the allocator's rules, not a GPU
(``benchmarks/calibrate.py`` measures one). Deterministic, no timing.

    python benchmarks/stand_in_reserve.py --out benchmarks/results/stand-in-reserve-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import statistics
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

from simulated_cuda import SimulatedAllocator, SimulatedCuda  # noqa: E402

from autotune._profile_data import Profile  # noqa: E402
from autotune.config import Timeline, TrainConfig  # noqa: E402
from autotune.cost._memory_model import MemoryModel  # noqa: E402
from autotune.device import _backend  # noqa: E402
from autotune.measure._memory_profile import memory_profile  # noqa: E402
from autotune.measure._profiler import Profiler  # noqa: E402
from autotune.models import gpt_batch, tiny_gpt  # noqa: E402
from autotune.verify._verifier import Verifier  # noqa: E402
from benchmarks.report import write_results  # noqa: E402

CPU = torch.device("cpu")


def fitted_only(profile: Profile) -> Profile:
    """``profile`` without its recorded requests: the fitted lines predict."""
    precisions = {k: dataclasses.replace(p, requests=()) for k, p in profile.precisions.items()}
    return dataclasses.replace(profile, precisions=precisions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--precisions", nargs="*", default=["fp32", "bf16"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    allocator = SimulatedAllocator(total=8 * 2**30)
    _backend._BACKENDS["cpu"] = functools.partial(SimulatedCuda, allocator=allocator)
    rows = []
    with allocator:
        model = tiny_gpt(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=256)
        blocks = tuple(f"blocks.{i}" for i in range(4))
        sample = gpt_batch(model.config, 4)
        foreign = allocator.reserved  # the user's model, as the tuner leaves it out
        work = copy.deepcopy(model)
        profiler = Profiler(work, sample, blocks, device=CPU, loss_fn=None, foreign_bytes=foreign)
        profile, _ = memory_profile(
            profiler,
            tuple(Timeline(p) for p in args.precisions),
            ("adamw",),
            device_name="stand-in",
            context_bytes=0,
        )
        del profiler
        models = {"fitted": MemoryModel(fitted_only(profile)), "replayed": MemoryModel(profile)}
        verifier = Verifier(
            work, sample, device=CPU, budget_bytes=4 * 2**30, loss_fn=None, foreign_bytes=foreign
        )
        for precision in args.precisions:
            for checkpoint in ((), blocks[:2], blocks):
                for b in (1, 4, 8, 16, 32, 64):
                    for accum in (1, 2):
                        config = TrainConfig(
                            micro_batch_size=b,
                            grad_accum_steps=accum,
                            precision=precision,
                            checkpoint=checkpoint,
                        )
                        measured, error = verifier.trial(config)
                        assert measured is not None, error
                        row = {"config": config.describe(), "measured": measured.peak_bytes}
                        for name, memory in models.items():
                            predicted = memory.memory(config)[0]
                            row[name] = (predicted - measured.peak_bytes) / measured.peak_bytes
                        rows.append(row)
                        print(
                            f"{config.describe():60s} fitted {row['fitted']:+.4f}  "
                            f"replayed {row['replayed']:+.4f}",
                            flush=True,
                        )
    summary = {}
    for name in ("fitted", "replayed"):
        for label, picked in (
            ("uniform", [r for r in rows if "checkpoint=2" not in r["config"]]),
            ("mixed", [r for r in rows if "checkpoint=2" in r["config"]]),
        ):
            errors = [abs(r[name]) for r in picked]
            summary[f"{name}_{label}"] = {
                "median": statistics.median(errors),
                "max": max(errors),
                "most_under": min(r[name] for r in picked),
            }
    write_results(args.out, rows, summary=summary)
    for key, figures in summary.items():
        print(key, {k: f"{100 * v:+.2f}%" for k, v in figures.items()})


if __name__ == "__main__":
    main()
