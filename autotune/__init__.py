"""autotune: the fastest way to train a PyTorch model inside a device-memory budget.

>>> result = autotune.autotune(model, sample_batch, budget_gb=24, global_batch_size=64)
>>> result.save("tuned.yaml")
>>> runner = autotune.prepare(model, autotune.load("tuned.yaml"), lr=3e-4)
>>> for batch in loader:
...     runner.step(batch)

The names below are the public API; the modules behind them are private. The names that
need torch (and the tuner, which needs optuna) are those of the typing block below,
each loaded with its module on first use (:mod:`autotune._interface`), so that
``autotune.prepare`` in a training job loads no tuner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import lazy_names
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
    from autotune.measure._peak import PeakReading, peak_memory
    from autotune.train._applied import Applied
    from autotune.train._batch_layout import (
        BatchLayout,
        ImagePatches,
        PackedSequences,
        SampleLists,
        add_batch_layout,
    )
    from autotune.train._chunked_loss import chunked_loss
    from autotune.train._prepare import apply, prepare
    from autotune.train._runner import Runner
    from autotune.train._sampler import LengthBucketSampler
    from autotune.tuning._autotune import autotune
    from autotune.tuning._estimate import Estimate, estimate
    from autotune.tuning._plan_ahead import plan_ahead

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
    "SampleLists",
    "SearchSpace",
    "TrainConfig",
    "TrialRecord",
    "TuneResult",
    "VerificationError",
    "__version__",
    "add_batch_layout",
    "apply",
    "autotune",
    "chunked_loss",
    "estimate",
    "find_blocks",
    "load",
    "peak_memory",
    "plan_ahead",
    "prepare",
]

__getattr__, __dir__ = lazy_names(__name__)
