"""Choosing the winner among verified configurations."""

from __future__ import annotations

import pytest

from autotune import Measurement, TrainConfig, TrialRecord, VerificationError
from autotune.verify._winner import fastest


def record(b: int, speed: float | None, peak: int = 100, error: str | None = None) -> TrialRecord:
    config = TrainConfig(micro_batch_size=b)
    predicted = Measurement(peak, b / 100.0, 100.0)
    measured = None if speed is None else Measurement(peak, b / speed, speed)
    return TrialRecord(config, predicted, measured, error)


def test_no_fit_is_an_error_that_lists_every_attempt() -> None:
    records = [record(8, None, error="out of memory"), record(4, None, error="over budget")]
    with pytest.raises(VerificationError, match="raise the budget") as info:
        fastest(records)
    assert info.value.attempts == (
        "micro_batch=8 accum=1 fp32 checkpoint=0 adamw: out of memory",
        "micro_batch=4 accum=1 fp32 checkpoint=0 adamw: over budget",
    )


def test_a_near_tie_goes_to_the_smaller_peak() -> None:
    fast = record(8, 100.0, peak=900)
    close = record(4, 99.5, peak=500)  # within 1%: the smaller peak is the safer pick
    slow = record(2, 90.0, peak=100)
    assert fastest([fast, close, slow]) is close
    assert fastest([record(8, 100.0, peak=900), slow]).config.micro_batch_size == 8
