"""Verification: candidates run for real on the device, under the budget.

* ``_verifier``: ``Verifier``, one configuration measured (peak and throughput).
* ``_winner``: which candidates to run, which one wins, timing close contenders again,
  with ``_lead`` (when one timing leads another beyond the noise).
* ``_ladder``: the fallback ladder, verified the same way.
* ``_studies``: a tuning run kept in an Optuna storage, to resume it or share it;
  ``_claims``: who does each of its jobs; ``_database``: opening its database.

The interface the other layers use is the table below (see :mod:`autotune._interface`);
each name loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune._interface import interface

if TYPE_CHECKING:
    from autotune.verify._claims import job_id
    from autotune.verify._fallbacks import fallback_ladder
    from autotune.verify._lead import BUSY, MOST_NOISE, QUIET, Noise
    from autotune.verify._studies import PROFILE_JOB, StudyStore, resolve_storage
    from autotune.verify._verifier import Verifier
    from autotune.verify._winner import Measure, choose_winner, fastest, settle, tied_with

INTERFACE = {
    "BUSY": "autotune.verify._lead",
    "MOST_NOISE": "autotune.verify._lead",
    "Measure": "autotune.verify._winner",
    "Noise": "autotune.verify._lead",
    "PROFILE_JOB": "autotune.verify._studies",
    "QUIET": "autotune.verify._lead",
    "StudyStore": "autotune.verify._studies",
    "Verifier": "autotune.verify._verifier",
    "choose_winner": "autotune.verify._winner",
    "fallback_ladder": "autotune.verify._fallbacks",
    "fastest": "autotune.verify._winner",
    "job_id": "autotune.verify._claims",
    "resolve_storage": "autotune.verify._studies",
    "settle": "autotune.verify._winner",
    "tied_with": "autotune.verify._winner",
}
"""What the other layers may import from here, by the private module that defines it."""

__all__ = [
    "BUSY",
    "MOST_NOISE",
    "PROFILE_JOB",
    "QUIET",
    "Measure",
    "Noise",
    "StudyStore",
    "Verifier",
    "choose_winner",
    "fallback_ladder",
    "fastest",
    "job_id",
    "resolve_storage",
    "settle",
    "tied_with",
]

__getattr__, __dir__ = interface(__name__, INTERFACE)
