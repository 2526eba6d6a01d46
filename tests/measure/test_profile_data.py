"""The profile's records: the lines fitted over micro-batch sizes, and the JSON round trip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autotune._profile_data import (
    Line,
    Requests,
    StepRequests,
    profile_from_json,
    profile_to_json,
)
from autotune.config import Timeline, TrainConfig
from autotune.cost._cost_model import CostModel


def test_a_rising_line_fits_the_points_least_squares() -> None:
    line = Line.rising([(2, 10.0), (4, 20.0), (8, 40.0)])
    assert line(2) == pytest.approx(10.0) and line(32) == pytest.approx(160.0)
    noisy = Line.rising([(1, 1.0), (2, 4.0), (3, 5.0)])
    assert noisy.slope == pytest.approx(2.0) and noisy.const == pytest.approx(-2 / 3)


def test_a_falling_fit_becomes_the_largest_value_so_larger_sizes_stay_covered() -> None:
    # Rounding weighs more at small sizes: what is left beyond the live bytes can fall.
    line = Line.rising([(2, 6.0), (4, 2.0)])
    assert line == Line(6.0, 0.0)
    assert Line.rising([(4, 3.0)]) == Line(3.0, 0.0)  # one size: a constant


def test_the_profile_survives_json_with_its_reserve_lines(gpt_profile) -> None:
    # An allocator's requests: a segment with a block in use and a free one, two requests.
    start = ((1 << 32, 0, True, False, ((512, True), (2**21 - 512, False))),)
    requests = Requests("expandable_segments:True", start, (Line(8.0, 4.0),), (0,), (0, -1), 9, 2)
    fp32 = dataclasses.replace(
        gpt_profile.precisions[Timeline("fp32")],
        reserve=(Line(1.0, 2.0), Line(3.0, 0.0)),
        requests=(requests, None),
    )
    step = StepRequests(start, (4096, 512), (0, 0), (0, 1, -2, -1))
    adamw = dataclasses.replace(gpt_profile.optimizers["adamw"], requests=step)
    profile = dataclasses.replace(
        gpt_profile,
        precisions={fp32.timeline: fp32},
        optimizers={**gpt_profile.optimizers, "adamw": adamw},
        untrainable=(1, 3),
    )
    assert profile_from_json(profile_to_json(profile)) == profile


def test_a_profile_saved_with_named_timelines_loads_and_saves_the_same() -> None:
    """A profile saved before timelines were typed (a study's, kept to resume: each
    timeline by its name) loads with typed timelines, predicts, and saves as it was."""
    text = (Path(__file__).parents[1] / "data" / "profile-with-named-timelines.json").read_text()
    profile = profile_from_json(text)
    fp32, bf16 = Timeline("fp32"), Timeline("bf16")
    assert list(profile.precisions) == [
        fp32,
        bf16,
        Timeline("bf16", "blocks"),
        Timeline("fp32", "model"),
    ]
    assert all(key == p.timeline for key, p in profile.precisions.items())
    saved = json.loads(profile_to_json(profile))
    assert saved.pop("reserve_cap") == 0  # fields added since, at their defaults
    assert all(o.pop("requests") is None for o in saved["optimizers"].values())
    assert saved == json.loads(text)
    config = TrainConfig(micro_batch_size=2, precision="bf16", compile_blocks=profile.blocks)
    assert CostModel(profile).memory(config)[0] > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_timeline_is_found_again_by_its_name(precision: str) -> None:
    for level in ("none", "blocks", "model"):
        for chunked in (False, True):
            timeline = Timeline(precision, level, chunked)
            assert Timeline.named(str(timeline)) == timeline
    assert str(Timeline(precision, "blocks", True)) == f"{precision}+compiled+chunked"
    assert str(Timeline(precision, "model")) == f"{precision}+model"
