"""The GPU kit's first step: what its jobs need, checked in seconds before any job runs.

A lent GPU gives one call of a few minutes: a job that dies on a missing package or a
device it cannot see costs that call. This checks, fastest first, the packages (optuna,
which the GPU machines lack unless the shared set-up brought it; torch; autotune), then
the device: that torch sees it, runs an op on it, and has the memory the jobs' budgets
need. Each problem is one line with what to do; the kit stops when one is found.
Packages the jobs can do without (bitsandbytes, for the QLoRA job only) are noted.

    python benchmarks/gpu_preflight.py                 # on the GPU machine, first
    python benchmarks/gpu_preflight.py --device cpu    # the smoke run's
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

_SET_UP = (
    "begin the command with `source .gpu/setup.sh &&` (`bash ../shared/gpu/kit.sh` fills "
    ".gpu/ on a machine that reaches the package index)"
)
"""What brings the packages a GPU machine lacks."""

REQUIRED = {
    "optuna": _SET_UP,
    "yaml": _SET_UP,
    "torch": "install a CUDA build of PyTorch",
    "transformers": "install transformers (the jobs build Hugging Face models)",
}
"""Packages every job imports, and what to do without one."""

OPTIONAL = {"bitsandbytes": "the QLoRA job is skipped (bash ../shared/gpu/kit.sh bitsandbytes)"}

_NEEDED_GIB = 24
"""The jobs' largest budget in the kit's one call."""


def problems(device: str) -> tuple[list[str], list[str]]:
    """(what stops the jobs, one line each with what to do; notes on what they skip)."""
    stops, notes = [], []
    for name, fix in REQUIRED.items():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            stops.append(f"{name} does not import ({exc}): {fix}")
    for name, what in OPTIONAL.items():
        try:
            importlib.import_module(name)
        except ImportError:
            notes.append(f"no {name}: {what}")
    if stops:  # the device checks need torch, and nothing runs anyway
        return stops, notes
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        importlib.import_module("autotune")
    except ImportError as exc:
        stops.append(f"autotune does not import ({exc}): {_SET_UP}")
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            return [*stops, "torch sees no CUDA device: check the driver (nvidia-smi)"], notes
        torch.ones(1, device="cuda").add_(1)
        free = torch.cuda.mem_get_info()[0] / 2**30
        if free < _NEEDED_GIB:
            stops.append(
                f"{free:.1f} GiB free on {torch.cuda.get_device_name()}: the jobs' budgets "
                f"need {_NEEDED_GIB}; stop what else holds it"
            )
        notes.append(
            f"{torch.cuda.get_device_name()}, {free:.1f} GiB free, torch {torch.__version__}"
        )
    return stops, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    stops, notes = problems(args.device)
    for line in notes:
        print(f"preflight: {line}")
    for line in stops:
        print(f"preflight: cannot run the jobs: {line}", file=sys.stderr)
    print(f"preflight: {'refused' if stops else 'ready'} in {time.perf_counter() - started:.1f} s")
    return 1 if stops else 0


if __name__ == "__main__":
    sys.exit(main())
