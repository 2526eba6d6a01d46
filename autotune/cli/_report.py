"""A tuned result for people: one self-contained HTML page (inline SVG, no scripts).

The page shows every configuration run for real as throughput against peak memory, with
the Pareto front (the best throughput at or under each peak), the budget line and the
chosen configuration; rejected runs are crosses at their predicted peak. Below: the
chosen configuration's memory by owner, each block kept or checkpointed, and the trials.
Readable offline: nothing is fetched. ``write_report(result, "x.png")`` needs matplotlib.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from autotune._files import write_atomic
from autotune._format import format_bytes
from autotune.cli._chart import COLORS, WIDTH, point, records, render_png, scatter
from autotune.cli._figures import figures, sureness
from autotune.config import TrainConfig
from autotune.errors import ConfigError
from autotune.result import PARTS, TuneResult

__all__ = ["render_html", "write_report"]


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
