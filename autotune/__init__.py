"""autotune: the fastest way to train a PyTorch model inside a device-memory budget.

>>> result = autotune.autotune(model, sample_batch, budget_gb=24, global_batch_size=64)
>>> result.save("tuned.yaml")
>>> runner = autotune.prepare(model, autotune.load("tuned.yaml"), lr=3e-4)
>>> for batch in loader:
...     runner.step(batch)

The names below are the public API; the modules behind them are private. The names that
need torch (and the tuner, which needs optuna) load on first use (as each subpackage's
interface does, :mod:`autotune._interface`), so that importing one layer, e.g.
``autotune.train`` in a training job, loads nothing it does not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface
from autotune._version import __version__
from autotune.config import TrainConfig
from autotune.errors import (
    AutotuneError,
    AutotuneWarning,
    BatchError,
    BlockError,
    BudgetError,
    BudgetTooSmallError,
    ConfigError,
    DistributedError,
    LossError,
    NonFiniteError,
    ProfileError,
    VerificationError,
)
from autotune.result import Breakdown, Costs, LengthRow, Measurement, TrialRecord, TuneResult, load
from autotune.space import SearchSpace

if TYPE_CHECKING:
    from autotune._blocks import find_blocks
    from autotune.measure._peak_memory import PeakReading, peak_memory
    from autotune.train._applied import Applied
    from autotune.train._batch_layout import (
        BatchLayout,
        ImagePatches,
        PackedSequences,
        add_batch_layout,
    )
    from autotune.train._prepare import apply, prepare
    from autotune.train._runner import Runner
    from autotune.train._sampler import LengthBucketSampler
    from autotune.tuning._ahead import plan_ahead
    from autotune.tuning._autotune import autotune
    from autotune.tuning._estimate import Estimate, estimate

__all__ = [
    "Applied",
    "AutotuneError",
    "AutotuneWarning",
    "BatchError",
    "BatchLayout",
    "BlockError",
    "Breakdown",
    "BudgetError",
    "BudgetTooSmallError",
    "ConfigError",
    "Costs",
    "DistributedError",
    "Estimate",
    "ImagePatches",
    "LengthBucketSampler",
    "LengthRow",
    "LossError",
    "Measurement",
    "NonFiniteError",
    "PackedSequences",
    "PeakReading",
    "ProfileError",
    "Runner",
    "SearchSpace",
    "TrainConfig",
    "TrialRecord",
    "TuneResult",
    "VerificationError",
    "__version__",
    "add_batch_layout",
    "apply",
    "autotune",
    "estimate",
    "find_blocks",
    "load",
    "peak_memory",
    "plan_ahead",
    "prepare",
]


_LAZY = {
    "Applied": "autotune.train._applied",
    "BatchLayout": "autotune.train._batch_layout",
    "ImagePatches": "autotune.train._batch_layout",
    "PackedSequences": "autotune.train._batch_layout",
    "add_batch_layout": "autotune.train._batch_layout",
    "LengthBucketSampler": "autotune.train._sampler",
    "PeakReading": "autotune.measure._peak_memory",
    "peak_memory": "autotune.measure._peak_memory",
    "apply": "autotune.train._prepare",
    "autotune": "autotune.tuning._autotune",
    "Estimate": "autotune.tuning._estimate",
    "estimate": "autotune.tuning._estimate",
    "find_blocks": "autotune._blocks",
    "plan_ahead": "autotune.tuning._ahead",
    "prepare": "autotune.train._prepare",
    "Runner": "autotune.train._runner",
}
"""Public names that import torch, by the module that defines them."""


__getattr__, __dir__ = interface(__name__, _LAZY)
