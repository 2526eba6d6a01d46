"""Calibration: what a training step holds on the device, four ways, against the prediction.

For each precision and micro-batch size, one model trains two optimizer steps (the second
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
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

import autotune
from autotune.device._backend import backend_for
from autotune.measure._peak import measure_peak
from autotune.measure._tracker import LiveBytesTracker, state_tensors
from autotune.train._batch import resize


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


class NvmlSampler:
    """The process's device memory seen by NVML, sampled every millisecond in a thread."""

    def __init__(self, device: torch.device) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid).encode())
            self._nvml = pynvml
        except Exception:  # no NVML here: the column stays empty
            self._handle = None

    def used(self) -> int | None:
        if self._handle is None:
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def __enter__(self) -> NvmlSampler:
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used() or 0)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._handle is not None:
            self._thread.join()


def point(
    model: torch.nn.Module, sample: Any, device: torch.device, b: int, p: str
) -> dict[str, Any]:
    config = autotune.TrainConfig(micro_batch_size=b, precision=p)
    predicted, _ = autotune.estimate(model, sample, config, device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    sampler = NvmlSampler(device)
    before = sampler.used()
    out: dict[str, Any] = {"micro_batch_size": b, "precision": p, "predicted": predicted}
    with sampler, autotune.prepare(copy.deepcopy(model), config, device=device) as runner:
        batch = resize(sample, b)
        runner.step(batch)  # allocates the optimizer state
        tracker = LiveBytesTracker(device.type)
        existing = state_tensors(runner.model, runner.optimizer, runner.scaler)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with measure_peak(device, existing=existing, tracker=tracker) as reading:
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
    parser.add_argument("--out", type=Path, default=Path("calibration.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    model, sample = model_and_batch(args.small, device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": str(torch.__version__),
        "points": [],
    }
    for p in args.precisions:
        for b in args.sizes:
            try:
                result["points"].append(point(model, sample, device, b, p))
            except torch.OutOfMemoryError as exc:
                result["points"].append({"micro_batch_size": b, "precision": p, "oom": str(exc)})
            args.out.write_text(json.dumps(result, indent=1))
            print(json.dumps(result["points"][-1]), flush=True)


if __name__ == "__main__":
    main()
