"""A tuned result for people: one self-contained HTML page (inline SVG, no scripts).

The page shows every configuration run for real as throughput against peak memory, with
the Pareto front (the best throughput at or under each peak), the budget line and the
chosen configuration; rejected runs are crosses at their predicted peak. Below: the
chosen configuration's memory by owner, each block kept or checkpointed, and the trials.
Readable offline: nothing is fetched. ``write_report(result, "x.png")`` needs matplotlib.

The report's charts: throughput against peak memory for every verified configuration
(SVG, or PNG with matplotlib), the Pareto front, and the memory bar's colours.
"""

from __future__ import annotations

import html
import io
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune._files import write_atomic
from autotune._format import format_bytes
from autotune.cli._figures import figures, sureness
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.result import PARTS, TrialRecord, TuneResult

__all__ = [
    "COLORS",
    "WIDTH",
    "pareto_front",
    "point",
    "records",
    "render_html",
    "render_png",
    "scatter",
    "write_report",
]


def write_report(result: TuneResult, path: str | Path) -> Path:
    """Write the report of ``result`` to ``path`` (``.html``/``.htm``, or ``.png``).

    Raises:
        ConfigError: another suffix, or ``.png`` without matplotlib installed.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".html", ".htm"):
        write_atomic(path, render_html(result))
    elif suffix == ".png":
        write_atomic(path, render_png(result))
    else:
        raise ConfigError(f"cannot write a report as {path.name!r}: name it *.html or *.png.")
    return path


def render_html(result: TuneResult) -> str:
    """The report as one HTML page with inline SVG and CSS."""
    c = result.config
    title = f"autotune: {result.model.class_name} on {result.target.name}"
    body = [
        f"<h1>{_esc(title)}</h1>",
        _summary(result),
        "<h2>Throughput against peak memory</h2>",
        scatter(result),
        "<h2>Memory of the chosen configuration (predicted peak)</h2>",
        _breakdown(result),
        "<h2>Blocks</h2>",
        _blocks(c, result.model.blocks),
        "<h2>Configurations run on the device</h2>",
        _trials(result),
    ]
    if result.by_length:
        body[2:2] = ["<h2>By sequence length</h2>", _lengths(result)]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 760px; color: #222; }
table { border-collapse: collapse; margin: .5em 0; }
td, th { padding: 2px 10px; text-align: left; border-bottom: 1px solid #ddd; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
.axis { stroke: #333; } .grid { stroke: #eee; }
.budget { stroke: #c00; stroke-dasharray: 6 4; stroke-width: 1.5; }
.pareto { fill: none; stroke: #4c72b0; stroke-width: 1.5; }
.fits { fill: #4c72b0; } .fallback { fill: #fff; stroke: #4c72b0; stroke-width: 2; }
.chosen { fill: #f0a500; stroke: #222; stroke-width: 1.5; }
.rejected { stroke: #c00; stroke-width: 2; }
.checkpointed { color: #c44e52; } .kept { color: #55a868; } .offloaded { color: #8172b2; }
.selective { color: #dd8452; }
""".strip()


def _summary(result: TuneResult) -> str:
    c = result.config
    rows = [
        ("configuration", c.describe()),
        ("effective batch", str(c.effective_batch_size)),
        *figures(result),
        *(("unverified", note) for note in result.unverified),
        *sureness(result),
        ("fallbacks", "; ".join(f.describe() for f in result.fallbacks) or "none"),
        (
            "tuned in",
            f"{result.tuning_s:.1f} s (profile {result.spent.profile_s:.1f} s, search "
            f"{result.spent.search_s:.1f} s, verification {result.spent.verification_s:.1f} s), "
            f"torch {result.target.torch_version}",
        ),
    ]
    return _table(("", ""), [(_esc(k), _esc(v)) for k, v in rows], header=False)


def _breakdown(result: TuneResult) -> str:
    b = result.breakdown
    values = {name: getattr(b, name) for name in PARTS}
    width, height, left = WIDTH - 20, 44, 10
    scale = (width - left) / max(result.budget_bytes, b.total, 1)
    box = f"width='{WIDTH}' height='{height + 20}' viewBox='0 0 {WIDTH} {height + 20}'"
    out = [f"<svg {box} role='img'>"]
    x = float(left)
    for name in PARTS:
        w = values[name] * scale
        out.append(
            f"<rect class='part-{name}' x='{x:.1f}' y='8' width='{w:.1f}' height='{height - 16}' "
            f"fill='{COLORS[name]}'><title>{name} {format_bytes(values[name])}</title></rect>"
        )
        x += w
    bx = left + result.budget_bytes * scale
    out.append(
        f"<line class='budget' x1='{bx:.1f}' y1='2' x2='{bx:.1f}' y2='{height - 2}'/>"
        f"<text x='{bx:.1f}' y='{height + 12}' text-anchor='end'>"
        f"budget {_esc(format_bytes(result.budget_bytes))}</text></svg>"
    )
    total = max(b.total, 1)
    rows = [
        (
            f"<span style='color:{COLORS[n]}'>&#9632;</span> {n}",
            f"<span class='num'>{_esc(format_bytes(values[n]))}</span>",
            f"{100 * values[n] / total:.1f}%",
        )
        for n in PARTS
    ]
    rows.append(("<b>total</b>", f"<b>{_esc(format_bytes(b.total))}</b>", "100%"))
    return "\n".join(out) + _table(("owner", "bytes", "share"), rows)


def _blocks(config: TrainConfig, blocks: Sequence[str]) -> str:
    if not blocks:
        return "<p>The model has no blocks: nothing can be checkpointed.</p>"
    rows = []
    for name in blocks:
        state = (
            "checkpointed"
            if name in config.checkpoint
            else "selective"
            if name in config.selective_checkpoint
            else "offloaded"
            if name in config.offload_activations
            else "kept"
        )
        rows.append((f"<code>{_esc(name)}</code>", f"<span class='{state}'>{state}</span>"))
    n, k = len(config.checkpoint), len(config.selective_checkpoint)
    selective = (
        f" {k} recompute only their cheap ops, keeping the outputs of their matrix products, "
        "convolutions and attention (selective);"
        if k
        else ""
    )
    return (
        f"<p>{n} of {len(blocks)} blocks recompute their activations in backward "
        f"(checkpointed);{selective} kept blocks hold theirs until backward.</p>"
        + _table(("block", "activations"), rows)
    )


def _lengths(result: TuneResult) -> str:
    """The table per sequence length: each row's config and what it measured."""
    rows = [
        (
            _num(str(r.length)),
            _esc(r.config.describe()),
            _num(format_bytes(m.peak_bytes)),
            _num(f"{m.samples_per_s:.1f}"),
            _num(f"{m.samples_per_s * r.length:.0f}"),
            _num(str(len(r.fallbacks))),
            _esc("measured" if r.measured else "predicted, not run"),
        )
        for r in result.by_length
        for m in [r.measured or r.predicted]
    ]
    head = ("up to length", "configuration", "peak", "samples/s", "tokens/s", "fallbacks", "")
    return _table(head, rows)


def _trials(result: TuneResult) -> str:
    rows = []
    for r in records(result):
        m = r.measured
        timed = m is not None and not r.peak_only  # a fallback's peak alone: not timed
        rows.append(
            (
                _esc(r.config.describe()),
                _num(format_bytes(r.predicted.peak_bytes)),
                _num(format_bytes(m.peak_bytes) if m else "-"),
                _num(f"{r.predicted.samples_per_s:.1f}"),
                _num(f"{m.samples_per_s:.1f}" if m and timed else "-"),
                _num(str(len(r.timings) or 1) if timed else "-"),
                _esc(point(result, r).note),
            )
        )
    head = (
        "configuration",
        "predicted peak",
        "measured peak",
        "predicted /s",
        "measured /s",
        "timings",
        "",
    )
    return _table(head, rows)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], *, header: bool = True) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>")
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows]
    out.append("</table>")
    return "\n".join(out)


def _num(text: str) -> str:
    return f"<span class='num'>{_esc(text)}</span>"


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


WIDTH, _H = 680, 380
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 30, 20, 64
COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",
    "other": "#8c8c8c",
}


@dataclass(frozen=True)
class _Point:
    """One configuration on the scatter."""

    config: TrainConfig
    peak: float
    speed: float
    role: str
    """``chosen``, ``fallback``, ``fits`` or ``rejected``."""
    note: str


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (peak, throughput) points no other point beats: lower or equal peak, faster.

    Returns:
        The front by ascending peak; each point is faster than the one before.
    """
    front: list[tuple[float, float]] = []
    for peak, speed in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or speed > front[-1][1]:
            front.append((peak, speed))
    return front


def records(result: TuneResult) -> list[TrialRecord]:
    """The trials, and the chosen configuration when they lack it (an old or hand-made result)."""
    trials = list(result.trials)
    if all(r.config != result.config for r in trials):
        trials.append(TrialRecord(result.config, result.predicted, result.measured))
    return trials


_BEYOND = 1.03
"""A rejected config is drawn this far past the budget line at least: it did not fit."""


def point(result: TuneResult, r: TrialRecord) -> _Point:
    if r.measured is None:  # it did not fit: beyond the budget, however low it was predicted
        pm = r.predicted
        peak = max(pm.peak_bytes, _BEYOND * result.budget_bytes)
        return _Point(r.config, peak, pm.samples_per_s, "rejected", r.error or "")
    fallback = next((i for i, f in enumerate(result.fallbacks, 1) if f == r.config), None)
    role = "chosen" if r.config == result.config else "fits" if fallback is None else "fallback"
    note = f"fallback {fallback}" if fallback is not None else role
    if r.peak_only:  # its peak alone was measured: drawn at its predicted speed, said so
        note += ", speed predicted"
        return _Point(r.config, r.measured.peak_bytes, r.predicted.samples_per_s, role, note)
    return _Point(r.config, r.measured.peak_bytes, r.measured.samples_per_s, role, note)


def _points(result: TuneResult) -> list[_Point]:
    return [point(result, r) for r in records(result)]


def scatter(result: TuneResult) -> str:
    points = _points(result)
    budget = result.budget_bytes
    x_max = _nice_bytes(max([budget, *(p.peak for p in points)]) * 1.05)
    x_min = x_floor(points, x_max)
    y_max = _nice_max(max([1e-9, *(p.speed for p in points)]) * 1.1)

    def sx(v: float) -> float:
        return _LEFT + (v - x_min) / (x_max - x_min) * (WIDTH - _LEFT - _RIGHT)

    def sy(v: float) -> float:
        return _H - _BOTTOM - v / y_max * (_H - _TOP - _BOTTOM)

    out = [f"<svg width='{WIDTH}' height='{_H}' viewBox='0 0 {WIDTH} {_H}' role='img'>"]
    out += _axes(x_min, x_max, y_max, sx, sy)
    out.append(
        f"<line class='budget' x1='{sx(budget):.1f}' y1='{_TOP}' x2='{sx(budget):.1f}' "
        f"y2='{_H - _BOTTOM}'><title>budget {format_bytes(budget)}</title></line>"
        f"<text x='{sx(budget) - 4:.1f}' y='{_TOP + 12}' text-anchor='end'>"
        f"budget {_esc(format_bytes(budget))}</text>"
    )
    front = pareto_front((p.peak, p.speed) for p in points if p.role != "rejected")
    if front:
        steps = [(front[0][0], front[0][1])]
        for (_, y0), (x1, y1) in itertools.pairwise(front):
            steps += [(x1, y0), (x1, y1)]
        steps.append((max(budget, front[-1][0]), front[-1][1]))
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in steps)
        out.append(f"<polyline class='pareto' points='{coords}'><title>Pareto front</title>")
        out.append("</polyline>")
    for p in sorted(points, key=lambda p: p.role == "chosen"):  # the chosen one on top
        out.append(_marker(p, sx(p.peak), sy(p.speed)))
    out += _legend()
    out.append("</svg>")
    return "\n".join(out)


def x_floor(points: list[_Point], x_max: float) -> float:
    """Where the memory axis starts: 0, or a round value below every point where they sit
    in the top half (an axis from 0 would crowd them into its right end)."""
    low = min((p.peak for p in points), default=0.0)
    if low < x_max / 2:
        return 0.0
    step = x_max / 10
    return math.floor(0.9 * low / step) * step


def _axes(x_min: float, x_max: float, y_max: float, sx: Any, sy: Any) -> list[str]:
    out = []
    for i in range(6):
        x, y = x_min + (x_max - x_min) * i / 5, y_max * i / 5
        out.append(
            f"<line class='grid' x1='{sx(x):.1f}' y1='{_TOP}' x2='{sx(x):.1f}' "
            f"y2='{_H - _BOTTOM}'/><text x='{sx(x):.1f}' y='{_H - _BOTTOM + 15}' "
            f"text-anchor='middle'>{_esc(format_bytes(x))}</text>"
            f"<line class='grid' x1='{_LEFT}' y1='{sy(y):.1f}' x2='{WIDTH - _RIGHT}' "
            f"y2='{sy(y):.1f}'/><text x='{_LEFT - 6}' y='{sy(y) + 4:.1f}' "
            f"text-anchor='end'>{_short(y)}</text>"
        )
    out.append(
        f"<line class='axis' x1='{_LEFT}' y1='{_H - _BOTTOM}' x2='{WIDTH - _RIGHT}' "
        f"y2='{_H - _BOTTOM}'/><line class='axis' x1='{_LEFT}' y1='{_TOP}' x2='{_LEFT}' "
        f"y2='{_H - _BOTTOM}'/>"
        f"<text x='{(_LEFT + WIDTH - _RIGHT) / 2}' y='{_H - _BOTTOM + 32}' text-anchor='middle'>"
        "peak device memory</text>"
        f"<text transform='translate(16 {(_TOP + _H - _BOTTOM) / 2}) rotate(-90)' "
        "text-anchor='middle'>samples/s</text>"
    )
    return out


def _marker(p: _Point, x: float, y: float) -> str:
    tip = _esc(
        f"{p.config.describe()}\n{p.note}\npeak {format_bytes(p.peak)}, {p.speed:.1f} samples/s"
        + ("\n(predicted speed; it did not fit)" if p.role == "rejected" else "")
    )
    if p.role == "rejected":
        return f"<path class='rejected' d='{_cross(x, y, 5)}'><title>{tip}</title></path>"
    r = 7 if p.role == "chosen" else 4.5
    return (
        f"<circle class='{p.role}' cx='{x:.1f}' cy='{y:.1f}' r='{r}'><title>{tip}</title></circle>"
    )


def _cross(x: float, y: float, r: float) -> str:
    """SVG path data of an x-shaped cross of half-width ``r`` centred on (x, y)."""
    a, b, c, d = x - r, x + r, y - r, y + r
    return f"M{a:.1f},{c:.1f}L{b:.1f},{d:.1f}M{a:.1f},{d:.1f}L{b:.1f},{c:.1f}"


def _legend() -> list[str]:
    """One row under the plot: marker, label; then the front and the budget line."""
    y = _H - 10
    items = [
        ("chosen", "chosen"),
        ("fallback", "fallback"),
        ("fits", "fits"),
        ("rejected", "rejected (did not fit)"),
    ]
    out, x = [], _LEFT
    for role, label in items:
        if role == "rejected":
            out.append(f"<path class='rejected' d='{_cross(x, y - 4, 4)}'/>")
        else:
            out.append(f"<circle class='{role}' cx='{x}' cy='{y - 4}' r='4.5'/>")
        out.append(f"<text x='{x + 9}' y='{y}'>{label}</text>")
        x += 30 + 6 * len(label)
    for cls, label in (("pareto", "Pareto front"), ("budget", "budget")):
        out.append(
            f"<line class='{cls}' x1='{x - 6}' y1='{y - 4}' x2='{x + 10}' y2='{y - 4}'/>"
            f"<text x='{x + 14}' y='{y}'>{label}</text>"
        )
        x += 40 + 6 * len(label)
    return out


def _nice_max(v: float) -> float:
    """``v`` rounded up to 1, 2, 2.5 or 5 times a power of ten (readable axis ends)."""
    if v <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(v))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= v)


def _nice_bytes(v: float) -> float:
    """Like :func:`_nice_max` in the unit ``format_bytes`` shows (KiB, MiB, GiB)."""
    unit = next((u for u in (2**30, 2**20, 2**10) if v >= u), 1)
    return _nice_max(v / unit) * unit


def _short(v: float) -> str:
    if v == 0:
        return "0"
    return f"{v / 1000:.1f}k" if v >= 10_000 else f"{v:.0f}" if v >= 10 else f"{v:.2f}"


def render_png(result: TuneResult) -> bytes:
    """The scatter and the memory bars as a PNG, with matplotlib (no pyplot state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "a PNG report needs matplotlib, which is not installed: pip install matplotlib, "
            "or write an HTML report (-o report.html)."
        ) from None
    mib = 2**20
    fig = Figure(figsize=(8, 7), layout="constrained")
    ax, bars = fig.subplots(2, 1, height_ratios=(3, 1))
    points = _points(result)
    for role, style in (
        ("fits", {"c": "#4c72b0"}),
        ("fallback", {"facecolors": "white", "edgecolors": "#4c72b0"}),
        ("rejected", {"c": "#c00", "marker": "x"}),
        ("chosen", {"c": "#f0a500", "edgecolors": "#222", "s": 90}),
    ):
        mine = [p for p in points if p.role == role]
        if mine:
            ax.scatter([p.peak / mib for p in mine], [p.speed for p in mine], label=role, **style)
    front = pareto_front((p.peak, p.speed) for p in points if p.role != "rejected")
    if front:
        ax.step([x / mib for x, _ in front], [y for _, y in front], where="post", label="Pareto")
    ax.axvline(result.budget_bytes / mib, color="#c00", linestyle="--", label="budget")
    x_max = max([result.budget_bytes, *(p.peak for p in points)]) * 1.05
    ax.set(
        xlabel="peak device memory (MiB)",
        ylabel="samples/s",
        xlim=(x_floor(points, x_max) / mib, None),
        ylim=(0, None),
    )
    ax.legend()
    left = 0.0
    for name in PARTS:
        width = getattr(result.breakdown, name) / mib
        bars.barh(0, width, left=left, color=COLORS[name], label=name)
        left += width
    bars.axvline(result.budget_bytes / mib, color="#c00", linestyle="--")
    bars.set(xlabel="MiB at the predicted peak", yticks=[])
    bars.legend(ncols=5, loc="upper center", bbox_to_anchor=(0.5, -0.6))
    image = io.BytesIO()
    fig.savefig(image, format="png")
    return image.getvalue()
