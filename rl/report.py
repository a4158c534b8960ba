"""`jointrl report RUN_DIR [--out FILE]`: one self-contained HTML page of a run, readable without wandb.

Reads what the run directory always has — `metrics.jsonl` (one row per step, names `<family>/<stat>/<domain>`),
`samples.jsonl` (rollout samples), and when present `config.json` and `eval_<label>.json` — and writes a single
HTML file: inline CSS, inline SVG plots drawn here in Python, a few lines of inline JS (sample filter, legend
toggles). No CDN or network: the page opens from a laptop or a cluster's shared disk alike.

Sections: per-domain reward (mean ± std band) and success curves; token / thinking-token / turn distributions
(box plots of the latest step from the quantiles rl/telemetry.py writes, and medians with p25-p75 bands over
time); rollout health (truncation, tool errors, zero-variance groups, sampling weights); policy (each loss term,
clip fractions, grad norm, entropy estimate, staleness); the train/inference logprob gap over time; MoE (expert
load x domain heatmap, max violation per layer x domain, router entropy, aux/z, replay mismatch,
expert-domain mutual information); the latest samples; held-out evals; every metric's latest value.
A plot whose metrics are absent from the run is replaced by a note naming the keys it looked for.

What it does not do: compute metrics (rl/telemetry.py, rl/moe_telemetry.py, the objective do), or read wandb.
"""
from __future__ import annotations

import html
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rl import report_domains
from rl.metrics import RunRecord, read_run_record

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
ALL_COLOR = "#333333"


class ReportError(ValueError):
    """The run directory cannot be turned into a report (message names the file and what is wrong)."""


# ---------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class RunData:
    """A run directory's logs, aligned by step. `series[key][i]` is the value at `steps[i]` (None = not logged)."""

    run_dir: Path
    name: str
    steps: tuple[int, ...]
    series: Mapping[str, tuple[float | None, ...]]
    times: tuple[float | None, ...]
    samples: tuple[Mapping[str, Any], ...] = ()
    config: Mapping[str, Any] | None = None
    evals: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    record: RunRecord | None = None  # RUN_DIR/run.json: the run's domains and families (None for older runs)

    @property
    def domains(self) -> tuple[str, ...]:
        """The run record's domains; for runs without one, those with a `reward/mean/<domain>` series
        (the driver logs it for every domain it rolled out), `all` excluded."""
        if self.record is not None:
            return tuple(sorted(self.record.names))
        return tuple(sorted(k[len("reward/mean/"):] for k in self.series if k.startswith("reward/mean/") and k != "reward/mean/all"))

    @property
    def family_of(self) -> dict[str, str]:
        fam = self.record.family_of() if self.record is not None else {}
        return {d: fam.get(d, d) for d in self.domains}

    @property
    def families(self) -> dict[str, tuple[str, ...]]:
        """family -> its domains (each domain its own family when the run has no record)."""
        out: dict[str, list[str]] = {}
        for d, f in sorted(self.family_of.items()):
            out.setdefault(f, []).append(d)
        return {f: tuple(out[f]) for f in sorted(out)}

    @property
    def many(self) -> bool:
        """Too many domains for one line per domain: charts show per-family means instead."""
        return len(self.domains) > report_domains.MANY

    def last(self, key: str) -> float | None:
        for v in reversed(self.series.get(key, ())):
            if v is not None:
                return v
        return None

    def last_step_with(self, keys: Sequence[str]) -> int | None:
        """Index of the latest step where any of `keys` has a value."""
        for i in range(len(self.steps) - 1, -1, -1):
            if any(self.series.get(k, (None,) * len(self.steps))[i] is not None for k in keys):
                return i
        return None


def _read_jsonl(path: Path, *, tolerate_torn_tail: bool) -> tuple[list[dict], list[str]]:
    rows, warnings = [], []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            # A run killed mid-write leaves a torn last line; anything else is corruption worth stopping for.
            if tolerate_torn_tail and i == len(lines):
                warnings.append(f"{path.name}: ignored an incomplete last line ({e.msg})")
                continue
            raise ReportError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path}: line {i} is a {type(row).__name__}, expected a JSON object")
        rows.append(row)
    return rows, warnings


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None if v is None else float(v)
    if isinstance(v, (int, float)):
        return float(v) if math.isfinite(v) else None
    return None


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory (see the module docstring). Raises ReportError naming what is missing or bad."""
    rd = Path(run_dir)
    if not rd.exists():
        raise ReportError(f"run directory {rd} does not exist")
    if not rd.is_dir():
        raise ReportError(f"{rd} is not a directory")
    mpath = rd / "metrics.jsonl"
    if not mpath.exists():
        raise ReportError(f"{mpath} not found: is {rd} a jointrl run directory? (training writes metrics.jsonl there)")
    rows, warnings = _read_jsonl(mpath, tolerate_torn_tail=True)
    by_step: dict[int, dict] = {}
    for i, row in enumerate(rows, 1):
        s = row.get("step")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or int(s) != s:
            raise ReportError(f"{mpath}: row {i} has no integer 'step' (got {s!r})")
        # A resumed run appends the steps it redid; the later row is the one that counted.
        by_step[int(s)] = row
    steps = tuple(sorted(by_step))
    keys = sorted({k for r in by_step.values() for k in r if k not in ("step", "time")})
    series = {k: tuple(_num(by_step[s].get(k)) for s in steps) for k in keys}
    times = tuple(_num(by_step[s].get("time")) for s in steps)
    samples: list[dict] = []
    spath = rd / "samples.jsonl"
    if spath.exists():
        samples, w = _read_jsonl(spath, tolerate_torn_tail=True)
        warnings += w
    config = None
    cpath = rd / "config.json"
    if cpath.exists():
        try:
            config = json.loads(cpath.read_text())
        except json.JSONDecodeError as e:
            warnings.append(f"config.json is not valid JSON ({e.msg}); run settings not shown")
    evals: dict[str, tuple] = {}
    for p in sorted(rd.glob("eval_*.json")):
        try:
            rows_e = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            warnings.append(f"{p.name} is not valid JSON ({e.msg}); skipped")
            continue
        if isinstance(rows_e, list) and all(isinstance(r, dict) for r in rows_e):
            evals[p.stem[len("eval_"):]] = tuple(rows_e)
    try:
        record = read_run_record(rd)
    except ValueError as e:
        record = None
        warnings.append(f"{e}; domains are taken from the reward/mean/<domain> metrics")
    name = str((config or {}).get("name") or rd.name)
    return RunData(run_dir=rd, name=name, steps=steps, series=series, times=times, samples=tuple(samples),
                   config=config, evals=evals, warnings=tuple(warnings), record=record)


# ---------------------------------------------------------------------------------------------- svg primitives
def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "–"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4g}"


def _tick(v: float) -> str:
    return f"{v:.3g}"


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
        return _missing(pid, title, "no finite values")
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

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg">']
    for t in yt:
        out.append(f'<line class="grid" x1="{ml}" x2="{ml + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}"/>'
                   f'<text class="tick" x="{ml - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{_e(_tick(t))}</text>')
    for t in xt:
        out.append(f'<line class="grid" x1="{X(t):.1f}" x2="{X(t):.1f}" y1="{mt}" y2="{mt + ph}"/>'
                   f'<text class="tick" x="{X(t):.1f}" y="{mt + ph + 16}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<rect class="frame" x="{ml}" y="{mt}" width="{pw}" height="{ph}"/>')
    out.append(f'<text class="axis" x="{ml + pw / 2:.1f}" y="{height - 4}" text-anchor="middle">{_e(xlabel)}</text>')
    if ylabel:
        out.append(f'<text class="axis" transform="translate(12,{mt + ph / 2:.1f}) rotate(-90)" text-anchor="middle">{_e(ylabel)}</text>')
    show_points = len(xs) <= 80
    for i, s in enumerate(series):
        g = [f'<g class="series" data-series="{i}" data-label="{_e(s.label)}">']
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
                             f'<title>{_e(s.label)} @ step {int(x)}: {_e(_fmt(y))}</title></circle>')
        g.append("</g>")
        out.append("".join(g))
    out.append("</svg>")
    legend = "".join(f'<span class="lg" data-series="{i}"><i style="background:{s.color}"></i>{_e(s.label)}</span>'
                     for i, s in enumerate(series))
    return (f'<figure class="plot" id="plot-{_e(pid)}" data-kind="line" data-series-count="{len(series)}">'
            f'<figcaption>{_e(title)}</figcaption>{"".join(out)}<div class="legend">{legend}</div></figure>')


def _diverging(v: float, center: float = 1.0) -> str:
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
        return _missing(pid, title, "empty matrix")
    lw = min(140, 8 + 7 * max(len(r) for r in row_labels))
    cw = max(6.0, min(44.0, 640.0 / C))
    ch = 24.0
    top = 22
    width = int(max(lw + cw * C + 10, lw + 5 * 46 + 10))  # room for the colour key
    height = int(top + ch * R + 46)
    out = [f'<svg class="chart heat" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg">']
    every = max(1, math.ceil(16 / cw))
    for j, c in enumerate(col_labels):
        if j % every == 0:
            out.append(f'<text class="tick" x="{lw + cw * (j + 0.5):.1f}" y="{top - 6}" text-anchor="middle">{_e(c)}</text>')
    for i, r in enumerate(row_labels):
        y = top + ch * i
        out.append(f'<text class="tick" x="{lw - 6}" y="{y + ch / 2 + 4:.1f}" text-anchor="end">{_e(r)}</text>')
        for j in range(C):
            v = float(M[i, j])
            out.append(f'<rect class="cell" x="{lw + cw * j:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                       f'fill="{_diverging(v, center)}"><title>{_e(r)} / {_e(col_labels[j])}: {_e(_fmt(v))}</title></rect>')
            if cw >= 34 and math.isfinite(v):
                out.append(f'<text class="cellv" x="{lw + cw * (j + 0.5):.1f}" y="{y + ch / 2 + 4:.1f}" text-anchor="middle">{v:.2f}</text>')
    # colour key: 0.25x .. 4x
    ky = top + ch * R + 14
    for k, v in enumerate((0.25, 0.5, 1.0, 2.0, 4.0)):
        x = lw + k * 46
        out.append(f'<rect x="{x}" y="{ky}" width="40" height="10" fill="{_diverging(v, center)}" class="key"/>'
                   f'<text class="tick" x="{x + 20}" y="{ky + 24}" text-anchor="middle">{v:g}×</text>')
    out.append("</svg>")
    cap = f'<p class="note">{_e(note)}</p>' if note else ""
    return (f'<figure class="plot" id="plot-{_e(pid)}" data-kind="heatmap" data-rows="{R}" data-cols="{C}">'
            f'<figcaption>{_e(title)}</figcaption>{"".join(out)}{cap}</figure>')


@dataclass(frozen=True)
class Box:
    label: str
    color: str
    q: Mapping[str, float]  # min, p25, p50, p75, max (p10/p90 optional)


def box_plot(pid: str, title: str, boxes: Sequence[Box], *, ylabel: str = "", note: str = "", width: int = 560, height: int = 250) -> str:
    """One vertical box per group: whiskers min..max, box p25..p75, median line, p10/p90 ticks when present."""
    if not boxes:
        return _missing(pid, title, "no quantiles logged")
    ml, mr, mt, mb = 58, 14, 10, 38
    pw, ph = width - ml - mr, height - mt - mb
    yt = nice_ticks(min(b.q["min"] for b in boxes), max(b.q["max"] for b in boxes))
    y0, y1 = yt[0], yt[-1]

    def Y(y: float) -> float:
        return mt + ph - (y - y0) / (y1 - y0) * ph

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg">']
    for t in yt:
        out.append(f'<line class="grid" x1="{ml}" x2="{ml + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}"/>'
                   f'<text class="tick" x="{ml - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{_e(_tick(t))}</text>')
    out.append(f'<rect class="frame" x="{ml}" y="{mt}" width="{pw}" height="{ph}"/>')
    if ylabel:
        out.append(f'<text class="axis" transform="translate(12,{mt + ph / 2:.1f}) rotate(-90)" text-anchor="middle">{_e(ylabel)}</text>')
    slot = pw / len(boxes)
    bw = min(46.0, slot * 0.5)
    for i, b in enumerate(boxes):
        cx = ml + slot * (i + 0.5)
        q = b.q
        tip = ", ".join(f"{k} {_fmt(q[k])}" for k in ("min", "p10", "p25", "p50", "p75", "p90", "max") if k in q)
        g = [f'<g class="box" data-label="{_e(b.label)}"><title>{_e(b.label)}: {_e(tip)}</title>',
             f'<line class="whisker" x1="{cx:.1f}" x2="{cx:.1f}" y1="{Y(q["min"]):.1f}" y2="{Y(q["max"]):.1f}" stroke="{b.color}"/>']
        for k in ("min", "max", "p10", "p90"):
            if k in q:
                w = bw / 2 if k in ("min", "max") else bw / 4
                g.append(f'<line class="whisker" x1="{cx - w:.1f}" x2="{cx + w:.1f}" y1="{Y(q[k]):.1f}" y2="{Y(q[k]):.1f}" stroke="{b.color}"/>')
        top, bot = Y(q["p75"]), Y(q["p25"])
        g.append(f'<rect class="iqr" x="{cx - bw / 2:.1f}" y="{top:.1f}" width="{bw:.1f}" height="{max(bot - top, 1.0):.1f}" '
                 f'fill="{b.color}" stroke="{b.color}"/>')
        g.append(f'<line class="median" x1="{cx - bw / 2:.1f}" x2="{cx + bw / 2:.1f}" y1="{Y(q["p50"]):.1f}" y2="{Y(q["p50"]):.1f}"/>')
        g.append(f'<text class="tick" x="{cx:.1f}" y="{mt + ph + 16}" text-anchor="middle">{_e(b.label)}</text></g>')
        out.append("".join(g))
    out.append("</svg>")
    cap = f'<p class="note">{_e(note)}</p>' if note else ""
    return (f'<figure class="plot" id="plot-{_e(pid)}" data-kind="box" data-series-count="{len(boxes)}">'
            f'<figcaption>{_e(title)}</figcaption>{"".join(out)}{cap}</figure>')


def _missing(pid: str, title: str, why: str) -> str:
    return (f'<figure class="plot missing" id="plot-{_e(pid)}" data-kind="missing"><figcaption>{_e(title)}</figcaption>'
            f'<p class="note">Not logged in this run: {_e(why)}.</p></figure>')


# ---------------------------------------------------------------------------------------------- report pieces
class _Ctx:
    """Per-report helpers: consistent domain colours and series lookup."""

    def __init__(self, run: RunData) -> None:
        self.run = run
        labels = list(run.families) if run.many else list(run.domains)
        self.colors = {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(labels)}
        self.xs = [float(s) for s in run.steps]

    def color(self, label: str) -> str:
        return self.colors.get(label, ALL_COLOR)

    def has(self, key: str) -> bool:
        return any(v is not None for v in self.run.series.get(key, ()))

    def domain_series(self, prefix: str, *, band: tuple[str, str] | None = None, band_std: str | None = None,
                      include_all: bool = True) -> list[Series]:
        """Series for every `prefix/<domain>` key (+ `prefix/all` dashed, + a bare `prefix` key as 'batch');
        with many domains, one series per family (the mean over its domains) instead."""
        out = []
        if self.run.many:
            out = [Series(f, ys, self.color(f)) for f, ys in report_domains.family_series(self.run, prefix).items()]
            if include_all and self.has(f"{prefix}/all"):
                out.append(Series("all", self.run.series[f"{prefix}/all"], ALL_COLOR, dashed=True))
            return out
        labels = [d for d in self.run.domains if self.has(f"{prefix}/{d}")]
        if include_all and self.has(f"{prefix}/all"):
            labels.append("all")
        for d in labels:
            ys = self.run.series[f"{prefix}/{d}"]
            b = None
            if band_std and self.has(f"{band_std}/{d}"):
                sd = self.run.series[f"{band_std}/{d}"]
                b = ([None if (m is None or s is None) else m - s for m, s in zip(ys, sd)],
                     [None if (m is None or s is None) else m + s for m, s in zip(ys, sd)])
            elif band and self.has(f"{band[0]}/{d}") and self.has(f"{band[1]}/{d}"):
                b = (self.run.series[f"{band[0]}/{d}"], self.run.series[f"{band[1]}/{d}"])
            out.append(Series(d, ys, self.color(d), dashed=(d == "all"), band=b))
        if self.has(prefix):
            out.append(Series("batch", self.run.series[prefix], ALL_COLOR, dashed=True))
        return out

    def key_series(self, keys: Sequence[str]) -> list[Series]:
        present = [k for k in keys if self.has(k)]
        return [Series(k, self.run.series[k], PALETTE[i % len(PALETTE)]) for i, k in enumerate(present)]

    def dom_chart(self, pid: str, title: str, prefix: str, ylabel: str = "", *, extra_keys: Sequence[str] = (), **kw) -> str:
        """Per-domain lines of `prefix/<domain>`, plus batch-wide `extra_keys` (dashed) when logged."""
        yrange = kw.pop("yrange", None)
        s = self.domain_series(prefix, **kw)
        s += [Series(k, self.run.series[k], ALL_COLOR, dashed=True) for k in extra_keys if self.has(k)]
        if not s:
            return _missing(pid, title, f"no '{prefix}/<domain>' metrics")
        return line_chart(pid, title, self.xs, s, ylabel=ylabel, yrange=yrange)

    def keys_chart(self, pid: str, title: str, keys: Sequence[str], ylabel: str = "", yrange=None) -> str:
        s = self.key_series(keys)
        if not s:
            return _missing(pid, title, "none of " + ", ".join(keys))
        return line_chart(pid, title, self.xs, s, ylabel=ylabel, yrange=yrange)

    def latest_boxes(self, prefix: str) -> tuple[list[Box], int | None]:
        need = ("min", "p25", "p50", "p75", "max")
        if self.run.many:  # hundreds of boxes read as noise; the per-domain table carries the numbers
            return [], None
        keys = [f"{prefix}_{q}/{d}" for d in self.run.domains for q in need]
        i = self.run.last_step_with(keys)
        if i is None:
            return [], None
        boxes = []
        for d in self.run.domains:
            q = {k: self.run.series.get(f"{prefix}_{k}/{d}", (None,) * len(self.run.steps))[i]
                 for k in ("min", "p10", "p25", "p50", "p75", "p90", "max")}
            if all(q[k] is not None for k in need):
                boxes.append(Box(d, self.color(d), {k: v for k, v in q.items() if v is not None}))
        return boxes, i


_LOSS_KEYS = ("loss/total", "pg/loss", "kl/value", "router/loss", "router/aux_loss", "router/z_loss", "dsa/indexer_loss",
              "value/loss", "sft/nll")


def _loss_charts(c: _Ctx) -> str:
    keys = list(_LOSS_KEYS) + sorted(k for k in c.run.series if k.startswith("loss/") and k not in _LOSS_KEYS)
    present = [k for k in keys if c.has(k)]
    if not present:
        return _missing("loss-terms", "Loss terms", "none of " + ", ".join(_LOSS_KEYS))
    # One small chart per term: they live on very different scales.
    inner = "".join(line_chart("loss-" + re.sub(r"[^a-z0-9]+", "-", k.lower()), k, c.xs,
                               [Series(k, c.run.series[k], PALETTE[i % len(PALETTE)])], width=360, height=200)
                    for i, k in enumerate(present))
    return f'<div class="plot-group" id="plot-loss-terms" data-kind="group" data-count="{len(present)}">{inner}</div>'


def _moe_heatmaps(c: _Ctx) -> str:
    run = c.run
    pat = re.compile(r"^moe/load_e(\d+)/(.+)$")
    found = [(int(m.group(1)), m.group(2)) for k in run.series if (m := pat.match(k))]
    if not found:
        hm = _missing("expert-domain-heatmap", "Expert load × domain", "no 'moe/load_e<expert>/<domain>' metrics (rl/moe_telemetry.py)")
    else:
        experts = sorted({e for e, _ in found})
        rows = [d for d in run.domains if any(dd == d for _, dd in found)] + (["all"] if any(dd == "all" for _, dd in found) else [])
        if run.many:  # per-domain rows are in the Domains section's family-grouped map
            return _missing("expert-domain-heatmap", "Expert load × domain",
                            f"{len(run.domains)} domains: see the family-grouped map in the Domains section")
        keys = [f"moe/load_e{e:03d}/{d}" for e in experts for d in rows]
        i = run.last_step_with(keys)
        # Average over the last few logged steps: one step's batch is small and noisy.
        idx = [j for j in range(len(run.steps)) if any(run.series.get(k, ())[j] is not None for k in keys if k in run.series)][-5:]
        M = np.full((len(rows), len(experts)), np.nan)
        for r, d in enumerate(rows):
            for col, e in enumerate(experts):
                vals = [run.series[k][j] for j in idx if (k := f"moe/load_e{e:03d}/{d}") in run.series and run.series[k][j] is not None]
                if vals:
                    M[r, col] = float(np.mean(vals))
        note = (f"Load = share of a domain's routing assignments that went to the expert, relative to uniform (1×), "
                f"averaged over MoE layers and over steps {run.steps[idx[0]]}–{run.steps[i]} ({len(idx)} logged steps). "
                "Red: the domain over-uses the expert; blue: under-uses it.")
        hm = heatmap("expert-domain-heatmap", "Expert load × domain", rows, [str(e) for e in experts], M, note=note)
    # per-layer max violation x domain at the latest step
    pat_l = re.compile(r"^moe/max_vio_l(\d+)/(.+)$")
    fl = [(int(m.group(1)), m.group(2)) for k in run.series if (m := pat_l.match(k))]
    if fl:
        layers = sorted({l for l, _ in fl})
        rows = [d for d in run.domains if any(dd == d for _, dd in fl)] + (["all"] if any(dd == "all" for _, dd in fl) else [])
        keys = [f"moe/max_vio_l{l:02d}/{d}" for l in layers for d in rows]
        i = run.last_step_with(keys)
        M = np.full((len(rows), len(layers)), np.nan)
        for r, d in enumerate(rows):
            for col, l in enumerate(layers):
                v = run.series.get(f"moe/max_vio_l{l:02d}/{d}", (None,) * len(run.steps))[i]
                M[r, col] = np.nan if v is None else v
        # MaxVio 0 = balanced: show 1 + MaxVio (the busiest expert's load) on the same 1x-centred scale.
        hv = heatmap("maxvio-layer-heatmap", f"Busiest expert's load (1 + MaxVio) per MoE layer × domain, step {run.steps[i]}",
                     rows, [f"L{l}" for l in layers], 1.0 + M,
                     note="MaxVio (Wang et al. 2024, arXiv:2408.15664) = max load / mean load − 1 per layer; 1× = perfectly balanced.")
    else:
        hv = _missing("maxvio-layer-heatmap", "Max violation per layer × domain", "no 'moe/max_vio_l<layer>/<domain>' metrics")
    return hm + hv


def _samples_table(run: RunData, ctx: _Ctx, limit_per_domain: int = 8) -> str:
    limit_per_domain = max(1, min(limit_per_domain, 200 // max(len(run.domains), 1)))  # bounded page size
    if not run.samples:
        return '<p class="note" id="samples-missing">No samples.jsonl rows in this run.</p>'
    last_step = max(int(s.get("step", -1)) for s in run.samples)
    latest = [s for s in run.samples if int(s.get("step", -1)) == last_step]
    per: dict[str, int] = {}
    rows = []
    for s in latest:
        d = str(s.get("domain", "?"))
        per[d] = per.get(d, 0) + 1
        if per[d] > limit_per_domain:
            continue
        transcript = str(s.get("transcript", ""))
        extra = {k: v for k, v in s.items() if k not in ("step", "domain", "task_id", "reward", "turns", "transcript")}
        extra_txt = "".join(f"<div><b>{_e(k)}</b>: {_e(v)}</div>" for k, v in sorted(extra.items()))
        rows.append(f'<tr data-domain="{_e(d)}"><td>{_e(s.get("step", ""))}</td>'
                    f'<td><i class="dot" style="background:{ctx.color(d)}"></i>{_e(d)}</td><td>{_e(s.get("task_id", ""))}</td>'
                    f'<td class="num">{_e(s.get("reward", ""))}</td><td class="num">{_e(s.get("turns", ""))}</td>'
                    f'<td><details><summary>{len(transcript)} chars</summary>{extra_txt}<pre>{_e(transcript)}</pre></details></td></tr>')
    doms = sorted(per)
    opts = '<option value="">all domains</option>' + "".join(f'<option value="{_e(d)}">{_e(d)}</option>' for d in doms)
    return (f'<p>Samples from step {last_step} (up to {limit_per_domain} per domain). '
            f'<label>Domain <select id="sample-filter">{opts}</select></label></p>'
            '<table id="samples" class="data"><thead><tr><th>step</th><th>domain</th><th>task</th><th>reward</th>'
            f'<th>turns</th><th>transcript</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _eval_tables(run: RunData) -> str:
    if not run.evals:
        return '<p class="note">No held-out evaluations (eval_*.json) in this run directory.</p>'
    out = []
    for label, rows in run.evals.items():
        cols = list(dict.fromkeys(k for r in rows for k in r))
        body = "".join("<tr>" + "".join(f'<td class="{"num" if isinstance(r.get(c), (int, float)) else ""}">'
                                        f'{_e(_fmt(r[c]) if isinstance(r.get(c), float) else r.get(c, ""))}</td>' for c in cols) + "</tr>"
                       for r in rows)
        out.append(f'<h3>{_e(label)}</h3><table class="data eval" data-label="{_e(label)}"><thead><tr>'
                   + "".join(f"<th>{_e(c)}</th>" for c in cols) + f"</tr></thead><tbody>{body}</tbody></table>")
    return "".join(out)


def _summary(run: RunData, c: _Ctx) -> str:
    t = [x for x in run.times if x is not None]
    dur = (t[-1] - t[0]) if len(t) >= 2 else None
    cards = [("steps logged", str(len(run.steps))), ("last step", str(run.steps[-1]) if run.steps else "–"),
             ("domains", (f"{len(run.domains)} in {len(run.families)} families" if run.many else ", ".join(run.domains)) or "–"),
             ("wall time", f"{dur / 60:.1f} min" if dur is not None else "–")]
    for d in ([] if run.many else run.domains):
        r, s = run.last(f"reward/mean/{d}"), run.last(f"success/rate/{d}")
        cards.append((f"{d}: reward / success", f"{_fmt(r)} / {_fmt(s)}"))
    html_cards = "".join(f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div></div>' for k, v in cards)
    cfg = ""
    if run.config:
        cfg = f'<details><summary>run config</summary><pre>{_e(json.dumps(run.config, indent=2, default=str))}</pre></details>'
    warn = "".join(f'<p class="warn">{_e(w)}</p>' for w in run.warnings)
    return f'<div class="cards">{html_cards}</div>{warn}{cfg}'


def _all_metrics(run: RunData) -> str:
    rows = []
    doms = set(run.domains) if run.many else set()  # per-domain values are in the Domains section's table
    for k in sorted(run.series):
        if doms and k.rsplit("/", 1)[-1] in doms:
            continue
        vals = [v for v in run.series[k] if v is not None]
        if not vals:
            continue
        rows.append(f"<tr><td>{_e(k)}</td><td class=num>{_e(_fmt(vals[-1]))}</td><td class=num>{_e(_fmt(min(vals)))}</td>"
                    f"<td class=num>{_e(_fmt(max(vals)))}</td><td class=num>{len(vals)}</td></tr>")
    return (f'<details id="all-metrics"><summary>{len(rows)} metrics: latest value, min, max, steps logged</summary>'
            '<table class="data"><thead><tr><th>metric</th><th>latest</th><th>min</th><th>max</th><th>n</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></details>')


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2d3d;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}header .sub{opacity:.8;font-size:12px}
nav{padding:6px 24px;background:#e9edf2;position:sticky;top:0;z-index:2}nav a{margin-right:14px;color:#1f4e79;text-decoration:none}
main{padding:8px 24px 40px}section{margin:18px 0}h2{border-bottom:1px solid #ccd;padding-bottom:4px;font-size:17px}
.grid2{display:flex;flex-wrap:wrap;gap:14px}.plot-group{display:flex;flex-wrap:wrap;gap:10px}
figure.plot{background:#fff;border:1px solid #dde;border-radius:6px;margin:0;padding:8px 10px}
figure.plot figcaption{font-weight:600;margin-bottom:4px}figure.missing{width:300px;color:#777}
svg.chart text{font-size:11px;fill:#444}svg .grid{stroke:#eee}svg .frame{fill:none;stroke:#bbb}
svg .line{fill:none;stroke-width:1.8}svg .band{opacity:.16;stroke:none}svg .whisker{stroke-width:1.4}
svg .iqr{fill-opacity:.35}svg .median{stroke:#111;stroke-width:2}svg .cellv{font-size:10px;fill:#222}svg .cell{stroke:#fff;stroke-width:.5}
.legend{font-size:12px}.lg{margin-right:10px;cursor:pointer;user-select:none}.lg.off{opacity:.35;text-decoration:line-through}
.lg i,.dot{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;vertical-align:middle}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{background:#fff;border:1px solid #dde;border-radius:6px;padding:6px 12px}
.card .k{font-size:11px;color:#666}.card .v{font-size:16px;font-weight:600}
table.data{border-collapse:collapse;background:#fff;font-size:12px}table.data td,table.data th{border:1px solid #dde;padding:3px 6px;vertical-align:top;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}pre{white-space:pre-wrap;max-width:900px;max-height:420px;overflow:auto;background:#f4f4f6;padding:6px}
.note{color:#666;font-size:12px;max-width:760px}.warn{color:#a15c00}
"""

# Only DOM APIs every browser has; the page must show no console errors (a test checks it in Chromium).
_JS = """
(function(){
  var sel = document.getElementById('sample-filter');
  if (sel) { sel.addEventListener('change', function(){
    var rows = document.querySelectorAll('#samples tbody tr');
    for (var i = 0; i < rows.length; i++) {
      rows[i].style.display = (!sel.value || rows[i].getAttribute('data-domain') === sel.value) ? '' : 'none';
    }
  }); }
  var figs = document.querySelectorAll('figure.plot');
  for (var f = 0; f < figs.length; f++) {
    (function(fig){
      var items = fig.querySelectorAll('.lg');
      for (var j = 0; j < items.length; j++) {
        items[j].addEventListener('click', function(){
          var g = fig.querySelector('g.series[data-series="' + this.getAttribute('data-series') + '"]');
          if (!g) { return; }
          var off = this.classList.toggle('off');
          g.style.display = off ? 'none' : '';
        });
      }
    })(figs[f]);
  }
  document.body.setAttribute('data-report-ready', String(figs.length));
})();
"""


def render_report(run: RunData) -> str:
    """The whole HTML page as a string (self-contained: no external resources)."""
    c = _Ctx(run)
    if not run.steps:
        body = '<p class="warn">metrics.jsonl has no rows yet: nothing to plot.</p>'
        sections = [("Summary", "summary", _summary(run, c) + body)]
    else:
        rates = (0.0, 1.0)
        tok_boxes, ti = c.latest_boxes("tokens/response")
        think_boxes, hi = c.latest_boxes("tokens/thinking")
        turn_boxes, ui = c.latest_boxes("turns/n")

        def boxes(pid: str, title: str, b: list[Box], i: int | None, ylabel: str) -> str:
            if not b:
                return _missing(pid, title, "no per-domain quantiles (rl/telemetry.py writes <metric>_p25/<domain> etc.)")
            return box_plot(pid, f"{title}, step {run.steps[i]}", b, ylabel=ylabel,
                            note="Box: p25–p75 with the median; whiskers: min–max; short ticks: p10 / p90.")

        sections = [
            ("Summary", "summary", _summary(run, c)),
            ("Rewards", "rewards", '<div class="grid2">'
             + c.dom_chart("reward-mean", "Reward mean per domain (band: ± std)", "reward/mean", "reward", band_std="reward/std")
             + c.dom_chart("success-rate", "Success rate per domain", "success/rate", "fraction", yrange=rates)
             + c.dom_chart("zero-var", "Zero-variance group fraction (no learning signal)", "rollout/zero_var_frac", "fraction", yrange=rates)
             + c.dom_chart("sampler-weight", "Domain sampling weight", "sampler/weight", "weight", yrange=rates)
             + "</div>"),
            ("Tokens and turns", "tokens", '<div class="grid2">'
             + boxes("tokens-response-box", "Response tokens per episode", tok_boxes, ti, "tokens")
             + boxes("tokens-thinking-box", "Thinking tokens per episode", think_boxes, hi, "tokens")
             + boxes("turns-box", "Turns per episode", turn_boxes, ui, "turns")
             + c.dom_chart("tokens-response-median", "Response tokens: median (band p25–p75)", "tokens/response_p50", "tokens",
                           band=("tokens/response_p25", "tokens/response_p75"))
             + c.dom_chart("tokens-thinking-mean", "Thinking tokens: mean", "tokens/thinking_mean", "tokens")
             + c.dom_chart("turns-mean", "Turns per episode: mean", "turns/mean", "turns")
             + "</div>"),
            ("Rollout health", "health", '<div class="grid2">'
             + c.dom_chart("truncated", "Truncation rate", "episode/truncated_rate", "fraction", yrange=rates)
             + c.dom_chart("tool-errors", "Tool-call error rate (errors + timeouts + malformed per call)", "tools/error_rate", "per call", yrange=rates)
             + c.dom_chart("grade-errors", "Grading error rate", "episode/grade_error_rate", "fraction", yrange=rates)
             + c.dom_chart("wall-time", "Episode wall time (mean)", "episode/wall_s_mean", "seconds")
             + c.dom_chart("sandbox-kills", "Sandbox kills per episode", "episode/sandbox_kills_mean", "kills")
             + c.keys_chart("step-time", "Step time breakdown", ["time/rollout_s", "time/train_s", "time/sync_s", "time/step_s"], "seconds")
             + "</div>"),
            ("Policy", "policy", _loss_charts(c) + '<div class="grid2">'
             + c.keys_chart("clipfrac", "Clip fractions (sequence level)", ["pg/clipfrac", "pg/clipfrac_low", "pg/clipfrac_high",
                                                                         "offpolicy/tis_capped_frac"], "fraction", yrange=rates)
             + c.dom_chart("token-clipfrac", "Token clip fraction (high) per domain", "pg/token_clipfrac_high", "fraction")
             + c.keys_chart("grad-norm", "Gradient norm (before clipping)", ["train/grad_norm"], "norm")
             + c.dom_chart("entropy", "Sampled-token −log p (entropy estimate)", "pg/neg_logprob_mean", "nats")
             + c.dom_chart("staleness", "Policy staleness (versions behind)", "policy/staleness_mean", "versions",
                           extra_keys=("policy/staleness",))
             + "</div>"),
            ("Train / inference gap", "gap", '<div class="grid2">'
             + c.dom_chart("logprob-gap", "|log p trainer − log p engine| on generated tokens (mean)", "mismatch/logprob_abs_mean", "nats")
             + c.dom_chart("logprob-gap-max", "… (max)", "mismatch/logprob_abs_max", "nats")
             + c.dom_chart("gap-kl", "KL(engine ‖ trainer), k3 estimate", "mismatch/kl_k3", "nats")
             + "</div>"),
            ("Mixture of experts", "moe", '<div class="grid2">' + _moe_heatmaps(c)
             + c.dom_chart("max-vio", "Max violation (mean over layers)", "moe/max_vio", "MaxVio")
             + c.dom_chart("router-entropy", "Router entropy / log E", "moe/router_entropy_norm", "fraction", yrange=rates)
             + c.dom_chart("moe-aux", "Load-balance aux loss per domain", "moe/aux_loss", "aux")
             + c.dom_chart("moe-z", "Router z-loss per domain", "moe/z_loss", "z")
             + c.dom_chart("replay-mismatch", "Routing-replay mismatch (expert slots)", "moe/replay_mismatch", "fraction", yrange=rates)
             + c.keys_chart("expert-domain-mi", "Expert–domain mutual information", ["moe/expert_domain_mi/all"], "nats")
             + "</div>"),
            ("Domains", "domains", report_domains.domains_section(run, _diverging)),
            ("Latest samples", "samples", _samples_table(run, c)),
            ("Held-out evaluation", "eval", _eval_tables(run)),
            ("All metrics", "metrics", _all_metrics(run)),
        ]
    nav = "".join(f'<a href="#sec-{sid}">{_e(title)}</a>' for title, sid, _ in sections)
    body = "".join(f'<section id="sec-{sid}"><h2>{_e(title)}</h2>{content}</section>' for title, sid, content in sections)
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>jointrl report — {_e(run.name)}</title>"
            f"<style>{_CSS}{report_domains.CSS}</style></head><body><header><h1>jointrl report — {_e(run.name)}</h1>"
            f"<div class=\"sub\">{_e(run.run_dir)} · generated {generated}</div></header><nav>{nav}</nav><main>{body}</main>"
            f"<script>{_JS}</script></body></html>\n")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render RUN_DIR's report to `out` (default RUN_DIR/report.html); returns the path written."""
    run = load_run(run_dir)
    path = Path(out) if out else Path(run_dir) / "report.html"
    if path.exists() and path.is_dir():
        raise ReportError(f"--out {path} is a directory; give a file name such as {path / 'report.html'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_report(run), encoding="utf-8")
    tmp.replace(path)  # a reader never sees a half-written page
    return path


def main(run_dir: str, out: str | None = None) -> int:
    """`jointrl report RUN_DIR [--out FILE]`: 0 on success, 2 when the run directory cannot be read."""
    try:
        path = write_report(run_dir, out)
    except ReportError as e:
        print(f"jointrl report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
