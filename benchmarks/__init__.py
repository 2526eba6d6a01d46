"""Benchmarks of autotune: the figures in BENCHMARKS.md come from ``benchmarks/run.py``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from torchvision_ops import declare_torchvision_ops

declare_torchvision_ops()  # the index's torchvision on a CPU torch: see tests/torchvision_ops.py
