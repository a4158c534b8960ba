"""The report's drawing primitives: inline SVG charts as HTML strings, no plotting library, no scripts.

`line_chart` (lines with optional shaded bands and a clickable legend), `heatmap` (a matrix coloured
around a centre value by `diverging`), `box_plot` (quantile boxes), `missing` (the note a chart shows when
its metrics are absent), `nice_ticks` (round axis ticks), and the text helpers `esc` / `fmt`.
They know nothing about runs, domains or metric names: rl/observe/report.py decides what to draw.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
ALL_COLOR = "#333333"



def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def fmt(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "–"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4g}"


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Labels for an axis' ticks, as short as they can be while no two are equal: fixed-point with the fewest
    decimals that tell them apart (0.2, 0.25, 0.3 -> "0.20", "0.25", "0.30"), scientific for very large or
    very small magnitudes, with as many digits as that takes."""
    vals = list(ticks)
    if not vals:
        return []
    big = max(abs(v) for v in vals)
    if big >= 1e6 or (0 < big < 1e-3):
        for p in range(1, 12):
            out = [f"{v:.{p}e}" for v in vals]
            if len(set(out)) == len(out):
                return out
        return [repr(v) for v in vals]
    for p in range(0, 12):
        out = [f"{v:.{p}f}" for v in vals]
        if len(set(out)) == len(out):
            return ["0" if set(x) <= {"0", ".", "-"} else x for x in out]
    return [repr(v) for v in vals]


def nice_ticks(lo: float, hi: float, n: int = 5, *, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi] with a 1/2/2.5/5 x 10^k spacing (about n ticks)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"nice_ticks: non-finite range [{lo}, {hi}]")
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(n, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, math.ceil(step))
    start = math.floor(lo / step + 1e-9) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9 or len(ticks) < 2:
        ticks.append(round(t, 12))
        t = start + len(ticks) * step
    if ticks[-1] < hi - step * 1e-9:
        ticks.append(round(start + len(ticks) * step, 12))
    return ticks


@dataclass(frozen=True)
class Series:
    """One line of a chart: ys aligned with the chart's xs; band = (lo, hi) per x, drawn as a shaded area."""

    label: str
    ys: Sequence[float | None]
    color: str
    dashed: bool = False
    band: tuple[Sequence[float | None], Sequence[float | None]] | None = None


def _segments(xs: Sequence[float], ys: Sequence[float | None]) -> list[list[tuple[float, float]]]:
    segs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys):
        if y is None:
            if segs[-1]:
                segs.append([])
        else:
            segs[-1].append((x, y))
    return [s for s in segs if s]


def _open_with_y_grid(title: str, width: int, height: int, ml: float, pw: float, yt: Sequence[float],
                      Y: Any) -> list[str]:
    """The opening <svg> tag of a chart and its horizontal grid lines with their tick labels at `yt`."""
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{esc(title)}" xmlns="http://www.w3.org/2000/svg">']
    for t, label in zip(yt, tick_labels(yt)):
        out.append(f'<line class="grid" x1="{ml}" x2="{ml + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}"/>'
                   f'<text class="tick" x="{ml - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{esc(label)}</text>')
    return out


def line_chart(pid: str, title: str, xs: Sequence[float], series: Sequence[Series], *, ylabel: str = "",
               xlabel: str = "step", yrange: tuple[float, float] | None = None, width: int = 560, height: int = 250) -> str:
    """A <figure class="plot"> with an inline SVG line chart and an HTML legend (click an entry to hide it)."""
    ml, mr, mt, mb = 58, 14, 10, 38
    pw, ph = width - ml - mr, height - mt - mb
    vals = [y for s in series for y in s.ys if y is not None]
    for s in series:
        if s.band:
            vals += [v for part in s.band for v in part if v is not None]
    if not vals or not xs:
        return missing(pid, title, "no finite values")
    lo, hi = min(vals), max(vals)
    if yrange is not None:
        lo, hi = min(lo, yrange[0]), max(hi, yrange[1])
    yt = nice_ticks(lo, hi)
    y0, y1 = yt[0], yt[-1]
    xt = nice_ticks(min(xs), max(xs), 6, integer=True)
    x0, x1 = xt[0], xt[-1]

    def X(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * pw

    def Y(y: float) -> float:
        return mt + ph - (y - y0) / (y1 - y0) * ph

    out = _open_with_y_grid(title, width, height, ml, pw, yt, Y)
    for t in xt:
        out.append(f'<line class="grid" x1="{X(t):.1f}" x2="{X(t):.1f}" y1="{mt}" y2="{mt + ph}"/>'
                   f'<text class="tick" x="{X(t):.1f}" y="{mt + ph + 16}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<rect class="frame" x="{ml}" y="{mt}" width="{pw}" height="{ph}"/>')
    out.append(f'<text class="axis" x="{ml + pw / 2:.1f}" y="{height - 4}" text-anchor="middle">{esc(xlabel)}</text>')
    if ylabel:
        out.append(f'<text class="axis" transform="translate(12,{mt + ph / 2:.1f}) rotate(-90)" text-anchor="middle">{esc(ylabel)}</text>')
    show_points = len(xs) <= 80
    for i, s in enumerate(series):
        g = [f'<g class="series" data-series="{i}" data-label="{esc(s.label)}">']
        if s.band:
            blo, bhi = s.band
            for seg in _segments(xs, [None if (a is None or b is None) else (a, b) for a, b in zip(blo, bhi)]):  # type: ignore[misc]
                pts = [(x, ab[1]) for x, ab in seg] + [(x, ab[0]) for x, ab in reversed(seg)]
                g.append(f'<polygon class="band" fill="{s.color}" points="'
                         + " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts) + '"/>')
        for seg in _segments(xs, s.ys):
            d = "M" + " L".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in seg)
            dash = ' stroke-dasharray="5,3"' if s.dashed else ""
            g.append(f'<path class="line" d="{d}" stroke="{s.color}"{dash}/>')
            if show_points or len(seg) == 1:
                for x, y in seg:
                    g.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="2.6" fill="{s.color}">'
                             f'<title>{esc(s.label)} @ step {int(x)}: {esc(fmt(y))}</title></circle>')
        g.append("</g>")
        out.append("".join(g))
    out.append("</svg>")
    legend = "".join(f'<span class="lg" data-series="{i}"><i style="background:{s.color}"></i>{esc(s.label)}</span>'
                     for i, s in enumerate(series))
    return (f'<figure class="plot" id="plot-{esc(pid)}" data-kind="line" data-series-count="{len(series)}">'
            f'<figcaption>{esc(title)}</figcaption>{"".join(out)}<div class="legend">{legend}</div></figure>')


def diverging(v: float, center: float = 1.0) -> str:
    """White at `center`, red above, blue below, saturating at 4x / 0.25x (log2 scale)."""
    if v is None or not math.isfinite(v):
        return "#eeeeee"
    t = max(-1.0, min(1.0, math.log2(max(v, 1e-6) / center) / 2.0))
    end = (215, 48, 31) if t > 0 else (44, 123, 182)
    a = abs(t)
    r, g, b = (round(255 + (c - 255) * a) for c in end)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(pid: str, title: str, row_labels: Sequence[str], col_labels: Sequence[str], M: np.ndarray, *,
            note: str = "", center: float = 1.0) -> str:
    """Rows x columns matrix as coloured cells (diverging around `center`), values in tooltips (and in cells if room)."""
    M = np.asarray(M, dtype=np.float64)
    R, C = M.shape
    if R == 0 or C == 0:
        return missing(pid, title, "empty matrix")
    lw = min(140, 8 + 7 * max(len(r) for r in row_labels))
    cw = max(6.0, min(44.0, 640.0 / C))
    ch = 24.0
    top = 22
    width = int(max(lw + cw * C + 10, lw + 5 * 46 + 10))  # room for the colour key
    height = int(top + ch * R + 46)
    out = [f'<svg class="chart heat" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{esc(title)}" xmlns="http://www.w3.org/2000/svg">']
    every = max(1, math.ceil(16 / cw))
    for j, c in enumerate(col_labels):
        if j % every == 0:
            out.append(f'<text class="tick" x="{lw + cw * (j + 0.5):.1f}" y="{top - 6}" text-anchor="middle">{esc(c)}</text>')
    for i, r in enumerate(row_labels):
        y = top + ch * i
        out.append(f'<text class="tick" x="{lw - 6}" y="{y + ch / 2 + 4:.1f}" text-anchor="end">{esc(r)}</text>')
        for j in range(C):
            v = float(M[i, j])
            out.append(f'<rect class="cell" x="{lw + cw * j:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                       f'fill="{diverging(v, center)}"><title>{esc(r)} / {esc(col_labels[j])}: {esc(fmt(v))}</title></rect>')
            if cw >= 34 and math.isfinite(v):
                out.append(f'<text class="cellv" x="{lw + cw * (j + 0.5):.1f}" y="{y + ch / 2 + 4:.1f}" text-anchor="middle">{v:.2f}</text>')
    # colour key: 0.25x .. 4x
    ky = top + ch * R + 14
    for k, v in enumerate((0.25, 0.5, 1.0, 2.0, 4.0)):
        x = lw + k * 46
        out.append(f'<rect x="{x}" y="{ky}" width="40" height="10" fill="{diverging(v, center)}" class="key"/>'
                   f'<text class="tick" x="{x + 20}" y="{ky + 24}" text-anchor="middle">{v:g}×</text>')
    out.append("</svg>")
    cap = f'<p class="note">{esc(note)}</p>' if note else ""
    return (f'<figure class="plot" id="plot-{esc(pid)}" data-kind="heatmap" data-rows="{R}" data-cols="{C}">'
            f'<figcaption>{esc(title)}</figcaption>{"".join(out)}{cap}</figure>')


@dataclass(frozen=True)
class Box:
    label: str
    color: str
    q: Mapping[str, float]  # min, p25, p50, p75, max (p10/p90 optional)


def box_plot(pid: str, title: str, boxes: Sequence[Box], *, ylabel: str = "", note: str = "", width: int = 560, height: int = 250) -> str:
    """One vertical box per group: whiskers min..max, box p25..p75, median line, p10/p90 ticks when present."""
    if not boxes:
        return missing(pid, title, "no quantiles logged")
    ml, mr, mt, mb = 58, 14, 10, 38
    pw, ph = width - ml - mr, height - mt - mb
    yt = nice_ticks(min(b.q["min"] for b in boxes), max(b.q["max"] for b in boxes))
    y0, y1 = yt[0], yt[-1]

    def Y(y: float) -> float:
        return mt + ph - (y - y0) / (y1 - y0) * ph

    out = _open_with_y_grid(title, width, height, ml, pw, yt, Y)
    out.append(f'<rect class="frame" x="{ml}" y="{mt}" width="{pw}" height="{ph}"/>')
    if ylabel:
        out.append(f'<text class="axis" transform="translate(12,{mt + ph / 2:.1f}) rotate(-90)" text-anchor="middle">{esc(ylabel)}</text>')
    slot = pw / len(boxes)
    bw = min(46.0, slot * 0.5)
    for i, b in enumerate(boxes):
        cx = ml + slot * (i + 0.5)
        q = b.q
        tip = ", ".join(f"{k} {fmt(q[k])}" for k in ("min", "p10", "p25", "p50", "p75", "p90", "max") if k in q)
        g = [f'<g class="box" data-label="{esc(b.label)}"><title>{esc(b.label)}: {esc(tip)}</title>',
             f'<line class="whisker" x1="{cx:.1f}" x2="{cx:.1f}" y1="{Y(q["min"]):.1f}" y2="{Y(q["max"]):.1f}" stroke="{b.color}"/>']
        for k in ("min", "max", "p10", "p90"):
            if k in q:
                w = bw / 2 if k in ("min", "max") else bw / 4
                g.append(f'<line class="whisker" x1="{cx - w:.1f}" x2="{cx + w:.1f}" y1="{Y(q[k]):.1f}" y2="{Y(q[k]):.1f}" stroke="{b.color}"/>')
        top, bot = Y(q["p75"]), Y(q["p25"])
        g.append(f'<rect class="iqr" x="{cx - bw / 2:.1f}" y="{top:.1f}" width="{bw:.1f}" height="{max(bot - top, 1.0):.1f}" '
                 f'fill="{b.color}" stroke="{b.color}"/>')
        g.append(f'<line class="median" x1="{cx - bw / 2:.1f}" x2="{cx + bw / 2:.1f}" y1="{Y(q["p50"]):.1f}" y2="{Y(q["p50"]):.1f}"/>')
        g.append(f'<text class="tick" x="{cx:.1f}" y="{mt + ph + 16}" text-anchor="middle">{esc(b.label)}</text></g>')
        out.append("".join(g))
    out.append("</svg>")
    cap = f'<p class="note">{esc(note)}</p>' if note else ""
    return (f'<figure class="plot" id="plot-{esc(pid)}" data-kind="box" data-series-count="{len(boxes)}">'
            f'<figcaption>{esc(title)}</figcaption>{"".join(out)}{cap}</figure>')


def missing(pid: str, title: str, why: str) -> str:
    return (f'<figure class="plot missing" id="plot-{esc(pid)}" data-kind="missing"><figcaption>{esc(title)}</figcaption>'
            f'<p class="note">Not logged in this run: {esc(why)}.</p></figure>')
