"""The fallback ladder on a fixed profile: which fallbacks are verified, and the order."""

from __future__ import annotations

from test_search import cost, study  # noqa: F401  (the fixture and the chooser)

from autotune import Measurement, TrainConfig, TrialRecord
from autotune.cost._candidates import best_config, fallback_candidates
from autotune.cost._cost_model import CostModel
from autotune.verify._verification import fallback_ladder


def as_predicted(asked: list[TrainConfig]):
    def measure(config: TrainConfig, predicted: Measurement) -> TrialRecord:
        asked.append(config)
        return TrialRecord(config, predicted, predicted, None)

    return measure


def test_fallbacks_are_verified_only_where_no_verified_config_goes_as_low(
    cost: CostModel,  # noqa: F811
) -> None:
    chooser = study(cost, 0.5)
    best = best_config(chooser)
    assert best is not None
    winner = TrialRecord(best.config, best.prediction.measurement, best.prediction.measurement)
    peak = best.prediction.measurement.peak_bytes
    extra = fallback_candidates(chooser, best.config, peak)
    assert len(extra) == 2  # the fastest at 3/4 of the peak, and the most frugal

    asked: list[TrainConfig] = []
    ladder = fallback_ladder(as_predicted(asked), chooser, winner, [winner])
    assert asked == [c.config for c in extra]  # nothing verified went as low: both run
    peaks = [peak] + [next(c.prediction.measurement.peak_bytes for c in extra
                           if c.config == f) for f in ladder]  # fmt: skip
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)

    # Another verified config, measured as low as the 3/4 fallback is predicted: that
    # fallback is not run; the frugal one, lower still, is.
    other = best.config.replace(checkpoint=tuple(cost.profile.blocks))
    assert other not in (c.config for c in extra)
    at = extra[0].prediction.measurement
    low = TrialRecord(other, at, Measurement(at.peak_bytes, at.step_s, at.samples_per_s))
    asked.clear()
    ladder = fallback_ladder(as_predicted(asked), chooser, winner, [winner, low])
    assert asked == [extra[1].config]
    assert ladder == [other, extra[1].config]
