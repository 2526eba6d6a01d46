"""autotune: the fastest way to train a PyTorch model inside a device-memory budget.

>>> result = autotune.autotune(model, sample_batch, budget_gb=24, global_batch_size=64)
>>> result.save("tuned.yaml")
>>> runner = autotune.prepare(model, autotune.load("tuned.yaml"), lr=3e-4)
>>> for batch in loader:
...     runner.step(batch)
"""

from .blocks import find_blocks
from .config import Breakdown, Measurement, TrainConfig, TrialRecord, TuneResult, load
from .errors import (
    AutotuneError,
    AutotuneWarning,
    BatchError,
    BlockError,
    BudgetError,
    BudgetTooSmallError,
    ConfigError,
    LossError,
    ProfileError,
    VerificationError,
)
from .runtime import Runner, prepare
from .space import SearchSpace
from .tune import autotune

__all__ = [
    "AutotuneError",
    "AutotuneWarning",
    "BatchError",
    "BlockError",
    "Breakdown",
    "BudgetError",
    "BudgetTooSmallError",
    "ConfigError",
    "LossError",
    "Measurement",
    "ProfileError",
    "Runner",
    "SearchSpace",
    "TrainConfig",
    "TrialRecord",
    "TuneResult",
    "VerificationError",
    "__version__",
    "autotune",
    "find_blocks",
    "load",
    "prepare",
]

__version__ = "0.1.0"
