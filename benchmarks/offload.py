"""Offload figures: its overhead, how well its time is predicted, how much larger a model fits.

    python benchmarks/offload.py --device cuda --out benchmarks/results/offload-cuda.json

Targets (BENCHMARKS.md): optimizer or activation offload costs at most 15% of the
throughput of the same config without it, when the copies can hide behind compute (a
micro-batch large enough); the predicted step time of offloaded configs is within 10% of
the measured one; with offload (and ``adamw8bit``) allowed, the largest model that tunes
under a budget has at least twice the parameters of the largest without.

On CPU the host is the device, so the memory figures are the tracker's accounting (host
copies not counted) and the time figures are plain memory copies: a smoke test of the
script, not figures to quote.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

import autotune
from autotune.config import Timeline
from autotune.cost._cost_model import CHECKPOINT, CostModel
from autotune.device._target import discover
from autotune.measure._collectives import measure_transfer
from autotune.measure._memory_profile import memory_profile
from autotune.measure._profiler import Profiler
from autotune.models import gpt_batch, tiny_gpt
from autotune.train._optimizers import available
from autotune.verify._verifier import Verifier


def overhead_and_prediction(device: torch.device, size: dict[str, int], b: int) -> list[dict]:
    """Measured and predicted throughput of offloaded configs against the plain one."""
    model = tiny_gpt(**size)
    sample = gpt_batch(model.config, b)
    precision = "bf16" if device.type == "cuda" else "fp32"
    target = discover(device)
    profiler = Profiler(
        copy.deepcopy(model).to(device),
        sample,
        autotune.find_blocks(model),
        device=device,
        loss_fn=None,
    )
    profile, _ = memory_profile(
        profiler,
        (Timeline(precision),),
        ("adamw",),
        device_name=target.name,
        context_bytes=0,
        transfer=measure_transfer(target),
    )
    blocks = profile.blocks
    base = autotune.TrainConfig(micro_batch_size=b, precision=precision)
    configs = {
        "plain": base,
        "offload_optimizer": base.replace(offload_optimizer=True),
        "offload_activations_all": base.replace(offload_activations=blocks),
        "offload_activations_half": base.replace(offload_activations=blocks[::2]),
    }
    verifier = Verifier(model, sample, device=device, budget_bytes=2**50, loss_fn=None)
    rows = []
    timed: dict[str, Any] = {}
    for name, config in configs.items():
        measured, error = verifier.trial(config)
        timed[name] = measured
        rows.append({"config": name, "measured": None if error else measured.samples_per_s})
    # Time curves at b/2 and b, as autotune() measures them, on top of the memory profile.
    curve_profile = _with_time(profile, model, sample, device, precision, b)
    cost = CostModel(curve_profile)
    for row in rows:
        config = configs[row["config"]]
        row["predicted"] = cost.predict(config).measurement.samples_per_s
        if row["measured"]:
            row["overhead"] = 1 - row["measured"] / rows[0]["measured"]
            row["prediction_error"] = row["predicted"] / row["measured"] - 1
    return rows


def _with_time(profile, model, sample, device, precision, b):
    import dataclasses

    from autotune._profile_data import TimeCurve

    profiler = Profiler(
        copy.deepcopy(model).to(device), sample, profile.blocks, device=device, loss_fn=None
    )
    sizes = sorted({max(1, b // 2), b})
    timeline = Timeline(precision)
    times = tuple(profiler.fwd_bwd_time(timeline, s) for s in sizes)
    ratio = profiler.fwd_bwd_time(timeline, b, every=CHECKPOINT) / times[-1] - 1
    curve = TimeCurve(tuple(sizes), times, (b,), (ratio,))
    weights = profiler.block_weights(timeline, b)
    optimizers = {
        k: dataclasses.replace(v, step_s=_step_s(profiler, b))
        for k, v in profile.optimizers.items()
    }
    precisions = {k: dataclasses.replace(v, time=curve) for k, v in profile.precisions.items()}
    return dataclasses.replace(
        profile, precisions=precisions, block_weights=weights, optimizers=optimizers
    )


def _step_s(profiler: Profiler, b: int) -> float:
    return profiler.optimizer("adamw", b).step_s


def largest_model(device: torch.device, budget_gb: float, space: autotune.SearchSpace) -> int:
    """Parameters of the largest GPT (in n_layer) that tunes under the budget."""
    best = 0
    for n_layer in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        model = tiny_gpt(n_layer=n_layer, n_embd=256, n_head=4, block_size=64, vocab_size=512)
        try:
            autotune.autotune(
                model,
                gpt_batch(model.config, 2),
                budget_gb=budget_gb,
                device=device,
                space=space,
                global_batch_size=2,
                n_trials=10,
            )
        except autotune.BudgetTooSmallError:
            break
        best = sum(p.numel() for p in model.parameters())
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results/offload.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.time()
    gpu = device.type == "cuda"
    size = (
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 1024, "vocab_size": 50304}
        if gpu
        else {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64, "vocab_size": 512}
    )
    rows = overhead_and_prediction(device, size, 16 if gpu else 8)
    budget = 2.0 if gpu else 0.02
    forced = None if gpu else True  # on CPU offload is opt-in
    plain = autotune.SearchSpace(offload_optimizer=False, offload_activations=False)
    wide = autotune.SearchSpace(
        optimizers=("adamw", "adamw8bit") if available("adamw8bit") else ("adamw",),
        offload_optimizer=forced,
        offload_activations=forced,
    )
    without, with_offload = (
        largest_model(device, budget, plain),
        largest_model(device, budget, wide),
    )
    out = {
        "device": str(device),
        "machine": discover(device).name,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "overhead": rows,
        "largest_model": {
            "budget_gb": budget,
            "without_offload": without,
            "with_offload": with_offload,
            "ratio": with_offload / max(without, 1),
        },
        "seconds": time.time() - started,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
