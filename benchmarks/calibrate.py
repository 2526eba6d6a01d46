"""Calibration: what a training step holds on the device, four ways, against the prediction.

For each variant (every block kept, checkpointed or compiled), precision and micro-batch
size, one model trains two optimizer steps (the second
at steady state, optimizer state allocated) and the step's peak is read as:

* ``live``: the live-bytes tracker (tensor storage bytes, what the cost model's timeline is in);
* ``allocated``: ``torch.cuda.max_memory_allocated`` (the caching allocator's blocks in use);
* ``reserved``: ``torch.cuda.max_memory_reserved`` (its segments, what the budget must hold),
  at steady state (the cache as the first step left it) and ``reserved_cold`` (a step from
  an empty cache, as the profiler and the verifier start);
* ``nvml``: the process's device memory as the driver sees it, sampled every millisecond by
  a thread (context and workspaces included), above what it was before the model existed;

and ``predicted`` is ``autotune.estimate`` for the same config, which counts the CUDA
context (``context``, read after the steps) where the other columns do not. The JSON is
rewritten after every point, so a run stopped at a time limit keeps what it measured.

    python benchmarks/calibrate.py --out calibration.json                 # GPT-2 124M, 1024 tokens
    python benchmarks/calibrate.py --small --device cpu --out /tmp/c.json  # smoke run
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/calibrate.py ...
    python benchmarks/calibrate.py --sizes 4 --traces DIR ...  # and each step's allocator trace
    python benchmarks/calibrate.py --sizes 2 4 --no-estimate --traces DIR  # traces only

With ``--traces`` the measured step of every point is recorded as an allocator trace
(``autotune/device/_allocator_trace.py``), which the allocator's model replays in the
tests (``tests/data/allocator-traces``).

The allocator's setting is read when CUDA starts, so each setting is a process of its own
(the JSON records it): the GPU kit runs both, to decide ``expandable_segments`` on evidence.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune
from autotune.device._allocator_trace import recording
from autotune.device._backend import backend_for
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import state_tensors, tracker_for
from autotune.train._batch import resize
from autotune.train._compiled import measured_compiling
from benchmarks.nvml_sampler import NvmlSampler


def model_and_batch(small: bool, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """GPT-2 124M at 1024 tokens (random weights, nothing downloaded), or a tiny GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if small:
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=512)
    else:
        config = GPT2Config()  # 12 layers, width 768, 1024 positions, vocab 50257
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (8, config.n_positions))
    return model, {"input_ids": ids, "labels": ids.clone()}


_VARIANTS = ("kept", "ckpt", "compiled", "offload")
"""Every block kept, checkpointed, compiled or with its activations offloaded to the host
(copies on a side stream)."""


def variant_config(model: torch.nn.Module, b: int, p: str, variant: str) -> autotune.TrainConfig:
    """The config of one calibration point."""
    blocks = tuple(autotune.find_blocks(model))
    knobs: dict[str, Any] = {
        "kept": {},
        "ckpt": {"checkpoint": blocks},
        "compiled": {"compile_blocks": blocks},
        "offload": {"offload_activations": blocks},
    }[variant]
    return autotune.TrainConfig(micro_batch_size=b, precision=p, **knobs)


def point(
    model: torch.nn.Module,
    sample: Any,
    device: torch.device,
    b: int,
    p: str,
    variant: str = "kept",
    traces: Path | None = None,
    predict: bool = True,
) -> dict[str, Any]:
    config = variant_config(model, b, p, variant)
    predicted = autotune.estimate(model, sample, config, device=device)[0] if predict else None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    sampler = NvmlSampler(device)
    before = sampler.used()
    out: dict[str, Any] = {
        "micro_batch_size": b,
        "precision": p,
        "variant": variant,
        "predicted": predicted,
    }
    with (
        sampler,
        measured_compiling(bool(config.compile_blocks)),
        autotune.prepare(copy.deepcopy(model), config, device=device) as runner,
    ):
        batch = resize(sample, b)
        runner.step(batch)  # allocates the optimizer state
        tracker = tracker_for(bool(config.compile_blocks), device.type)  # compiled stays so
        existing = state_tensors(runner.model, runner.optimizer, runner.scaler)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(":", "-")
        name = "-".join(x for x in (variant, p, f"b{b}", setting.replace(",", "-")) if x)
        trace = Path(traces or ".") / f"{name}.json.gz"  # the setting in the name: one folder
        with (
            recording(trace, device, config=config.describe())
            if traces
            else contextlib.nullcontext(),
            measure_peak(device, existing=existing, tracker=tracker) as reading,
        ):
            runner.step(batch)
        out["live"] = reading.live_peak_bytes
        out["peak"] = reading.peak_bytes  # autotune's definition (CUDA: reserved + context 0)
        if cuda:
            out["allocated"] = int(torch.cuda.max_memory_allocated(device))
            out["reserved"] = int(torch.cuda.max_memory_reserved(device))
            # ``predicted`` counts the context; ``peak`` above does not (no context given).
            out["context"] = backend_for(device).context_bytes()
            # The same step from an empty cache, as the profiler and the verifier start.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            runner.step(batch)
            out["reserved_cold"] = int(torch.cuda.max_memory_reserved(device))
    if before is not None:
        out["nvml_above_start"] = sampler.peak - before
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a tiny GPT-2 (smoke run)")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--precisions", nargs="*", default=["fp32", "bf16"])
    parser.add_argument("--variants", nargs="*", default=["kept"], choices=_VARIANTS)
    parser.add_argument("--out", type=Path, default=Path("calibration.json"))
    parser.add_argument(
        "--traces", type=Path, help="record each measured step's allocator trace in DIR"
    )
    parser.add_argument(
        "--no-estimate", action="store_true", help="measure and trace only (no prediction)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    model, sample = model_and_batch(args.small, device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": str(torch.__version__),
        # expandable_segments:True or not: set before CUDA starts, so one process each
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "points": [],
    }
    for variant in args.variants:
        for p in args.precisions:
            for b in args.sizes:
                try:
                    measured = point(
                        model, sample, device, b, p, variant, args.traces, not args.no_estimate
                    )
                    result["points"].append(measured)
                except torch.OutOfMemoryError as exc:
                    result["points"].append(
                        {"micro_batch_size": b, "precision": p, "variant": variant, "oom": str(exc)}
                    )
                args.out.write_text(json.dumps(result, indent=1))
                print(json.dumps(result["points"][-1]), flush=True)


if __name__ == "__main__":
    main()
