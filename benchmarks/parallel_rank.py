"""One rank of ``benchmarks/parallel.py``: ``python parallel_rank.py JOB`` under the
environment a launcher sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
Prints ``RESULT <json>`` on rank 0.

``{"measure": [config, ...], "model": {...}}``: for each config, the per-rank peak
``autotune.estimate`` predicts from one process's profile, and what the ranks measure over
steps 2 to 4 (the first makes the optimizer state) under the tracker verification uses:
the largest rank's steady step (its least peak) and the largest peak of any step. ``{"tune": {...}}``: ``autotune.autotune`` on every rank, timed. ``{"readings": {...}}``: the
winner's peak three ways (see :func:`readings`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from storage_count import StorageCount

import autotune
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors
from autotune.models import gpt_batch, tiny_gpt
from autotune.train._parallel import agree_max


def measure(shape: dict[str, int], spec: dict[str, Any], world: int) -> dict[str, Any]:
    model = tiny_gpt(**shape)
    knobs = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
    config = autotune.TrainConfig(**knobs, world_size=world)
    local = config.effective_batch_size
    data = gpt_batch(model.config, local * world * 4, seed=1)
    sample = tuple(t[:4] for t in data)
    predicted, _ = autotune.estimate(model, sample, config, device="cpu")
    runner = autotune.prepare(model, config, lr=1e-4, device="cpu")
    peaks = []
    for step in range(4):
        start = (step * world + dist.get_rank()) * local
        batch = tuple(t[start : start + local] for t in data)
        with measure_peak(
            torch.device("cpu"),
            existing=state_tensors(runner.model, runner.optimizer),
            gathering=[runner.model],
        ) as reading:
            runner.step(batch)
        if step:  # the first makes the optimizer state
            peaks.append(reading.peak_bytes)
    runner.close()
    # Over the ranks: the largest steady step, and the largest step at all (gloo's thread
    # sometimes frees a reduce-scatter buffer late).
    steady, measured = agree_max([min(peaks), max(peaks)], torch.device("cpu"))
    return {
        "config": config.describe(),
        "predicted": predicted,
        "steady": int(steady),
        "measured": int(measured),
    }


def tune(job: dict[str, Any]) -> dict[str, Any]:
    if job.get("shallow"):  # a stand-in for a device that cannot hold the whole model
        from autotune.measure import _depth

        _depth._WHOLE_SHARE = 0.0
    model = tiny_gpt(**job["model"])
    sample = gpt_batch(model.config, 8, seed=1)
    started = time.perf_counter()
    result = autotune.autotune(
        model, sample, job["budget_gb"], global_batch_size=job["global_batch"], device="cpu"
    )
    wall = agree_max([time.perf_counter() - started], torch.device("cpu"))[0]
    fitted = [t for t in result.trials if t.measured is not None]
    return {
        "config": result.config.describe(),
        "tuning_s": wall,
        "spent": vars(result.spent),
        "trials": len(result.trials),
        "errors": [
            (t.predicted.peak_bytes - t.measured.peak_bytes) / t.measured.peak_bytes
            for t in fitted
            if t.measured is not None
        ],
        "peak": result.measured.peak_bytes,
        "budget": result.budget_bytes,
        "verified": [
            (t.config.describe(), t.predicted.peak_bytes, t.measured.peak_bytes)
            for t in fitted
            if t.measured is not None
        ],
    }


def readings(job: dict[str, Any]) -> dict[str, Any]:
    """``autotune.autotune`` on every rank, then three readings of three steps of the
    winner, the first included: its prediction, ``autotune.peak_memory`` around the runner
    and :class:`StorageCount`, which shares nothing with autotune's tracker."""
    model = tiny_gpt(**job["model"])
    result = autotune.autotune(
        model,
        gpt_batch(model.config, 8, seed=1),
        job["budget_gb"],
        global_batch_size=job["global_batch"],
        device="cpu",
    )  # the model as it was: autotune measures copies
    local, world = result.config.effective_batch_size, dist.get_world_size()
    data = gpt_batch(model.config, local * world * 3, seed=2)
    runner = autotune.prepare(model, result.config, lr=1e-4, device="cpu")
    first = dist.get_rank() * local
    mine = [tuple(t[first + s * world * local :][:local].clone() for t in data) for s in range(3)]
    held = [t for batch in mine for t in batch]
    with (
        StorageCount([*state_tensors(runner.model, runner.optimizer), *held]) as count,
        autotune.peak_memory(runner) as reading,
    ):
        for batch in mine:
            runner.step(batch)
    runner.close()
    batches = sum(t.nbytes for t in held)
    # The largest rank's of each (the last rank's shards can be shorter).
    peak, counted = agree_max([reading.peak_bytes, count.peak - batches], torch.device("cpu"))
    return {
        "config": result.config.describe(),
        "budget": result.budget_bytes,
        "predicted": result.predicted.peak_bytes,
        "verified": result.measured.peak_bytes,
        "peak_memory": int(peak),
        "count": int(counted),
    }


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        if "measure" in job:
            out: Any = [measure(job["model"], spec, world) for spec in job["measure"]]
        elif "readings" in job:
            out = readings(job["readings"])
        else:
            out = tune(job["tune"])
        dist.barrier()  # every rank done with its collectives before the group goes
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
