"""Verification: candidates run for real on the device, under the budget.

* ``_verifier``: ``Verifier``, one configuration measured (peak and throughput).
* ``_winner``: which candidates to run, which one wins, timing close contenders again,
  with ``_noise`` (when one timing leads another beyond the noise).
* ``_fallbacks``: the fallback ladder, verified the same way.
* ``_baseline``: the expert's recipe, verified in every run: the config to beat.

The interface the other layers use is ``__all__``: the names imported below. The
modules behind them are private to the package (``tests/test_layout.py`` holds both).
"""

from __future__ import annotations

from autotune.verify._baseline import baseline_candidates, baseline_record, verify_baseline
from autotune.verify._fallbacks import fallback_ladder
from autotune.verify._noise import BUSY, MOST_NOISE, QUIET, Noise
from autotune.verify._verifier import Verifier
from autotune.verify._winner import Measure, choose_winner, fastest, settle, tied_with

__all__ = [
    "BUSY",
    "MOST_NOISE",
    "QUIET",
    "Measure",
    "Noise",
    "Verifier",
    "baseline_candidates",
    "baseline_record",
    "choose_winner",
    "fallback_ladder",
    "fastest",
    "settle",
    "tied_with",
    "verify_baseline",
]
