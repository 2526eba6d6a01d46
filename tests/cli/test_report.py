"""The HTML report: a self-contained page whose charts show the trials, front and budget."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from autotune.cli._report import pareto_front, render_html, write_report
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.result import (
    Breakdown,
    Measurement,
    ModelInfo,
    Spent,
    TargetInfo,
    TrialRecord,
    TuneResult,
)

MIB = 2**20
BLOCKS = ("blocks.0", "blocks.1", "blocks.2")


def m(peak_mib: float, speed: float) -> Measurement:
    return Measurement(int(peak_mib * MIB), 1.0, speed)


@pytest.fixture
def result() -> TuneResult:
    """Five trials: the winner, two fallbacks, one slower fit and one out of memory."""
    chosen = TrainConfig(micro_batch_size=8, checkpoint=("blocks.1",))
    frugal = TrainConfig(micro_batch_size=2, grad_accum_steps=4, checkpoint=BLOCKS)
    middle = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    slow = TrainConfig(micro_batch_size=8, precision="bf16")
    oom = TrainConfig(micro_batch_size=16)
    trials = (
        TrialRecord(oom, m(95, 900), None, "out of memory: budget guard"),
        TrialRecord(chosen, m(70, 700), m(72, 650), timings=(1.01, 0.98, 1.0)),
        TrialRecord(slow, m(60, 600), m(62, 300)),
        TrialRecord(middle, m(50, 500), m(51, 480)),
        TrialRecord(frugal, m(20, 200), m(21, 210)),
    )
    return TuneResult(
        config=chosen,
        predicted=m(70, 700),
        measured=m(72, 650),
        budget_bytes=80 * MIB,
        target=TargetInfo("cuda:0", "Test GPU", 2**34, "2.13"),
        model=ModelInfo("GPT", "0123456789abcdef", 10**6, BLOCKS),
        breakdown=Breakdown(10 * MIB, 10 * MIB, 20 * MIB, 25 * MIB, 5 * MIB),
        fallbacks=(middle, frugal),
        trials=trials,
        tuning_s=12.5,
        spent=Spent(profile_s=4.0, search_s=0.5, verification_s=7.5),
    )


def svgs(page: str) -> list[ET.Element]:
    """The inline SVG charts, parsed (so they are well-formed XML)."""
    return [ET.fromstring(s) for s in re.findall(r"<svg.*?</svg>", page, re.S)]


def test_pareto_front_keeps_the_fastest_at_or_under_each_peak() -> None:
    points = [(5, 10), (1, 2), (3, 1), (2, 4), (4, 4), (2, 3)]
    assert pareto_front(points) == [(1, 2), (2, 4), (5, 10)]
    assert pareto_front([]) == []


def test_scatter_marks_every_trial_the_front_and_the_budget(result: TuneResult) -> None:
    scatter, _ = svgs(render_html(result))
    circles = scatter.findall("circle")
    roles = sorted(c.get("class", "") for c in circles if c.find("title") is not None)
    assert roles == ["chosen", "fallback", "fallback", "fits"]
    rejected = [p for p in scatter.findall("path") if p.find("title") is not None]
    assert len(rejected) == 1 and "out of memory" in (rejected[0].findtext("title") or "")

    def x_of(element: ET.Element) -> float:
        return float(element.get("cx") or element.get("x1") or 0)

    (budget,) = [
        e
        for e in scatter.findall("line")
        if e.get("class") == "budget" and e.find("title") is not None
    ]
    xs = {c.get("class"): x_of(c) for c in circles if c.find("title") is not None}
    assert all(x < x_of(budget) for x in xs.values())  # everything verified fits
    cross = [float(v) for v in re.findall(r"[\d.]+", rejected[0].get("d", ""))]
    assert (cross[0] + cross[2]) / 2 > x_of(budget)  # at its predicted 95 MiB, past 80 MiB
    (front,) = scatter.findall("polyline")
    corners = {tuple(map(float, p.split(","))) for p in (front.get("points") or "").split()}
    chosen = next(c for c in circles if c.get("class") == "chosen")
    assert (float(chosen.get("cx") or 0), float(chosen.get("cy") or 0)) in corners
    slow = next(c for c in circles if c.get("class") == "fits")  # beaten: not on the front
    assert (float(slow.get("cx") or 0), float(slow.get("cy") or 0)) not in corners


def test_memory_bars_and_block_table(result: TuneResult) -> None:
    page = render_html(result)
    _, bars = svgs(page)
    widths = {r.get("class"): float(r.get("width") or 0) for r in bars.findall("rect")}
    assert widths["part-activations"] == pytest.approx(2.5 * widths["part-parameters"], rel=0.01)
    assert widths["part-optimizer"] == pytest.approx(2 * widths["part-gradients"], rel=0.01)
    rows = re.findall(r"<code>(blocks\.\d)</code></td><td><span class='(\w+)'>", page)
    assert rows == [("blocks.0", "kept"), ("blocks.1", "checkpointed"), ("blocks.2", "kept")]
    assert "1 of 3 blocks" in page


def test_page_is_self_contained(result: TuneResult) -> None:
    page = render_html(result)
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "http" not in page and "src=" not in page
    assert "micro_batch=8 accum=1 fp32 checkpoint=1 adamw" in page
    assert "fallback 2" in page and "out of memory: budget guard" in page
    # where the time went, and how many timings decided each measured speed
    assert "12.5 s (profile 4.0 s, search 0.5 s, verification 7.5 s)" in page
    rows = re.findall(r"<tr><td>micro_batch=8 accum=1 fp32 checkpoint=1 adamw</td>(.*?)</tr>", page)
    cells = [re.findall(r"<span class='num'>(.*?)</span>", r) for r in rows]
    assert ["72.0 MiB", "650.0", "3"] in [[c[1], c[3], c[4]] for c in cells if len(c) == 5]


def test_a_result_without_trials_still_shows_the_chosen_config(result: TuneResult) -> None:
    import dataclasses

    bare = dataclasses.replace(result, trials=(), fallbacks=())
    scatter, _ = svgs(render_html(bare))
    assert [c.get("class") for c in scatter.findall("circle") if c.find("title") is not None] == [
        "chosen"
    ]


def test_write_report_by_suffix(
    result: TuneResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_report(result, tmp_path / "report.html")
    assert path.read_text(encoding="utf-8") == render_html(result)
    with pytest.raises(ConfigError, match=r"\*\.html or \*\.png"):
        write_report(result, tmp_path / "report.pdf")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match="needs matplotlib"):
        write_report(result, tmp_path / "report.png")
    assert not (tmp_path / "report.png").exists()


def test_png_with_matplotlib(result: TuneResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = write_report(result, tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rejected_config_is_drawn_past_the_budget_and_the_axis_fits_the_points(
    result: TuneResult,
) -> None:
    import dataclasses

    chosen = next(t for t in result.trials if t.config == result.config)
    # predicted at 40 MiB, but it ran out of memory: it did not fit the 80 MiB budget
    under = TrialRecord(TrainConfig(micro_batch_size=12), m(40, 800), None, "out of memory")
    crowded = dataclasses.replace(result, trials=(under, chosen), fallbacks=())
    scatter, _ = svgs(render_html(crowded))
    (budget,) = [
        e
        for e in scatter.findall("line")
        if e.get("class") == "budget" and e.find("title") is not None
    ]
    (cross,) = [p for p in scatter.findall("path") if p.find("title") is not None]
    xs = [float(v) for v in re.findall(r"[\d.]+", cross.get("d", ""))]
    assert (xs[0] + xs[2]) / 2 > float(budget.get("x1") or 0)  # beyond the budget line
    assert "it did not fit" in (cross.findtext("title") or "")
    ticks = [t.text for t in scatter.findall("text") if t.get("text-anchor") == "middle"]
    assert ticks[0] not in ("0 B", "0.0 B")  # the memory axis starts near the points
