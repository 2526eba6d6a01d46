"""The exception hierarchy of autotune.

Every error autotune raises on purpose derives from :class:`AutotuneError`, and its
message says what was wrong and what to do about it. Out-of-memory conditions are not
ours: they stay ``torch.OutOfMemoryError`` (the CPU budget guard raises that type too),
so one ``except torch.OutOfMemoryError`` catches a real and a simulated one alike.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import FrameType

__all__ = [
    "AutotuneError",
    "AutotuneWarning",
    "BatchError",
    "BlockError",
    "BudgetError",
    "BudgetTooSmallError",
    "ConfigError",
    "DistributedError",
    "LossError",
    "NonFiniteError",
    "ProfileError",
    "VerificationError",
    "warn",
]


class AutotuneError(Exception):
    """The root of autotune's exceptions."""


class BudgetError(AutotuneError, ValueError):
    """The memory budget is not a usable number (e.g. zero or negative)."""


class BudgetTooSmallError(BudgetError):
    """No configuration in the search space fits the budget.

    Attributes:
        minimum_bytes: The least budget that tunes: the least predicted peak over the
            search space, with the search's head-room above it.
        budget_bytes: The budget that was asked for.
        peak_bytes: The least predicted peak over the search space.
    """

    def __init__(
        self, message: str, *, minimum_bytes: int, budget_bytes: int, peak_bytes: int = 0
    ) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.budget_bytes = budget_bytes
        self.peak_bytes = peak_bytes

    def __reduce__(self) -> tuple[object, ...]:  # pickled to the other ranks of a group
        return (_rebuild, (type(self), str(self), vars(self)))


class BatchError(AutotuneError, TypeError):
    """The sample batch has an unsupported type or inconsistent batch sizes."""


class LossError(AutotuneError):
    """No scalar loss can be derived from the model's output."""


class ConfigError(AutotuneError, ValueError):
    """A configuration or YAML file is malformed, has unknown keys or wrong types."""


class BlockError(AutotuneError, ValueError):
    """The model's blocks cannot be found, or a named block does not exist."""


class DistributedError(AutotuneError, RuntimeError):
    """Data-parallel tuning or training cannot go on: no process group, one of another
    size than the config's, or a rank that failed or stopped answering."""


class NonFiniteError(AutotuneError, FloatingPointError):
    """A training step's loss or gradients are not finite (NaN or inf): the step was not
    applied, the weights keep their last finite values, and the gradients are freed."""


class ProfileError(AutotuneError):
    """The model cannot be profiled on the target (e.g. the forward pass fails)."""


class VerificationError(AutotuneError):
    """No candidate configuration passed verification on the device.

    Attributes:
        attempts: One line per candidate that was tried and why it was rejected.
    """

    def __init__(self, message: str, *, attempts: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.attempts = attempts

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), str(self), vars(self)))


class AutotuneWarning(UserWarning):
    """Something the user should know, e.g. a fallback config taking over after an OOM."""


_PACKAGE = str(Path(__file__).resolve().parent)


def warn(message: str, category: type[Warning] = AutotuneWarning) -> None:
    """Warn at the line that called into autotune: the caller of the outermost autotune
    frame on the stack (the user's line, or a trainer's hook), however deep the call."""
    frame: FrameType | None = sys._getframe(1)
    level, outermost = 1, 1
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            outermost = level
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=outermost + 2)


def _rebuild(cls: type[AutotuneError], message: str, attrs: dict[str, object]) -> AutotuneError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    vars(error).update(attrs)
    return error
