"""Verification: candidates run for real on the device, under the budget.

* ``_verification``: ``verification``, the sequence a tuning run verifies with, top to
  bottom, and ``Verification``, what it decided; the expert's recipe verified in every
  run (the config to beat), and the fallback ladder, verified the same way.
* ``_verifier``: ``Verifier``, one configuration measured (peak and throughput), and the
  evaluation batch of the winner and its fallbacks.
* ``_winner``: which candidates to run, which one wins, timing close contenders again,
  with ``_noise`` (when one timing leads another beyond the noise), and ``max_tuning_s``
  (``TimeBudget``: the runs it still allows and what it skipped).

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.verify._noise import MOST_NOISE
from autotune.verify._verification import Verification, verification
from autotune.verify._verifier import Verifier

__all__ = ["MOST_NOISE", "Verification", "Verifier", "verification"]
