"""The caching allocator's reserve predicted two ways against what it reserved (issue 48),
on the CPU stand-in (``tests/simulated_cuda.py``: every storage the CPU allocates goes
through the allocator's model, so the reserve follows the allocator's rules on real
request sequences).

A GPT is profiled at micro-batch 2 and 4 (every block kept, and checkpointed) and
verified at 8 and 32 (and at 8 with 4 micro-batches a step, and with 2 of the 4
blocks checkpointed). Predicted: the live peak plus what the allocator reserves beyond
it, (a) by the line fitted over the profiled sizes, (b) by the allocator's model fed the
profiled step's requests at the config's size. Deterministic, no timing.

    python benchmarks/allocator_replay.py --out benchmarks/results/allocator-replay-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

import torch  # noqa: E402
from simulated_cuda import SimulatedAllocator, SimulatedCuda  # noqa: E402

from autotune.config import TrainConfig  # noqa: E402
from autotune.cost._memory_model import MemoryModel  # noqa: E402
from autotune.device import _backend  # noqa: E402
from autotune.measure._memory_profile import memory_profile  # noqa: E402
from autotune.measure._profiler import Profiler  # noqa: E402
from autotune.models import gpt_batch, tiny_gpt  # noqa: E402
from autotune.verify._verifier import Verifier  # noqa: E402
from benchmarks.report import write_results  # noqa: E402

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("allocator-replay.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    allocator = SimulatedAllocator(total=8 * 2**30)
    _backend._BACKENDS["cpu"] = functools.partial(SimulatedCuda, allocator=allocator)
    rows = []
    with allocator:
        model = tiny_gpt(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=256)
        blocks = tuple(f"blocks.{i}" for i in range(4))
        sample = gpt_batch(model.config, 4)
        foreign = allocator.reserved
        work = copy.deepcopy(model)
        profiler = Profiler(work, sample, blocks, device=CPU, loss_fn=None, foreign_bytes=foreign)
        profile, _ = memory_profile(
            profiler, ("fp32",), ("adamw",), device_name="sim", context_bytes=0
        )
        del profiler
        replayed = MemoryModel(profile)
        fp32 = dataclasses.replace(profile.precisions["fp32"], requests=())
        fitted = MemoryModel(dataclasses.replace(profile, precisions={"fp32": fp32}))
        verifier = Verifier(
            work, sample, device=CPU, budget_bytes=2**30, loss_fn=None, foreign_bytes=foreign
        )
        configs = [
            TrainConfig(micro_batch_size=b, checkpoint=checkpoint)
            for checkpoint in ((), blocks)
            for b in (8, 32)
        ]
        configs += [  # several micro-batches a step; two blocks of four checkpointed
            TrainConfig(micro_batch_size=8, grad_accum_steps=4),
            TrainConfig(micro_batch_size=8, checkpoint=blocks[:2]),
        ]
        for config in configs:
            measured, error = verifier.run(config)
            assert error is None and measured is not None, error
            row = {"config": config.describe(), "measured": measured.peak_bytes}
            for name, memory in (("fitted", fitted), ("replayed", replayed)):
                predicted = memory.memory(config)[0]
                row[name] = predicted
                row[f"{name}_error_percent"] = round(
                    100 * (predicted - measured.peak_bytes) / measured.peak_bytes, 2
                )
            rows.append(row)
            print(row, flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
