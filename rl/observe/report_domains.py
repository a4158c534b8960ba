"""The report's per-domain pieces that stay readable at hundreds of domains (used by rl/observe/report.py).

From the run record's domains and families (rl/observe/record.py: RunRecord) and the per-domain series:
- per-family roll-ups: domains, latest mean reward / success / zero-variance fraction / weight, change;
- top movers: the domains whose reward rose or fell most (mean of the last `window` logged steps
  minus the first `window`);
- a per-domain table with a reward sparkline per row, a search box (domain or family text) and
  sortable columns (click a header);
- the expert x domain load heat map with rows grouped by family (families in name order, domains in a
  family ordered by their most-loaded expert, so a family's shared preference shows as a block), one
  thin row per domain, family names on the left.
It reads only the `RunData` that rl/observe/report_data.py's `load_run` gives; it computes no training metric.
"""
from __future__ import annotations

import html
import math
from typing import Any, Callable, Sequence

import numpy as np

from rl.observe.names import per_domain as _k
from rl.observe.report_data import RunData


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _f(v: float | None, nd: int = 3) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{nd}f}"


def _vals(run: RunData, key: str) -> list[float]:
    return [v for v in run.series.get(key, ()) if v is not None]


def latest(run: RunData, key: str) -> float | None:
    v = _vals(run, key)
    return v[-1] if v else None


def change(run: RunData, key: str, window: int = 3) -> float | None:
    v = _vals(run, key)
    if len(v) < 2:
        return None
    w = max(1, min(window, len(v) // 2))
    return float(np.mean(v[-w:]) - np.mean(v[:w]))


def family_series(run: RunData, prefix: str) -> dict[str, list[float | None]]:
    """family -> per-step mean of `prefix/<domain>` over its domains (None where none is logged)."""
    out = {}
    n = len(run.steps)
    for fam, doms in run.families.items():
        cols = [run.series[_k(prefix, d)] for d in doms if _k(prefix, d) in run.series]
        if not cols:
            continue
        out[fam] = [None if not (xs := [c[i] for c in cols if c[i] is not None]) else float(np.mean(xs)) for i in range(n)]
    return out


def sparkline(ys: Sequence[float | None], w: int = 90, h: int = 18) -> str:
    pts = [(i, y) for i, y in enumerate(ys) if y is not None]
    if len(pts) < 2:
        return ""
    lo, hi = min(y for _, y in pts), max(y for _, y in pts)
    span = (hi - lo) or 1.0
    n = max(len(ys) - 1, 1)
    path = " ".join(f"{1 + (w - 2) * i / n:.1f},{h - 1 - (h - 2) * (y - lo) / span:.1f}" for i, y in pts)
    return f'<svg class="spark" width="{w}" height="{h}" viewBox="0 0 {w} {h}"><polyline points="{path}"/></svg>'


def _rollups(run: RunData) -> str:
    rows = []
    for fam, doms in run.families.items():
        def mean_of(key_fn) -> float | None:
            xs = [x for d in doms if (x := key_fn(d)) is not None]
            return float(np.mean(xs)) if xs else None
        rows.append((fam, len(doms), mean_of(lambda d: latest(run, _k("reward/mean", d))),
                     mean_of(lambda d: change(run, _k("reward/mean", d))), mean_of(lambda d: latest(run, _k("success/rate", d))),
                     mean_of(lambda d: latest(run, _k("rollout/zero_var_frac", d))),
                     sum(x for d in doms if (x := latest(run, _k("sampler/weight", d))) is not None)))
    body = "".join(f'<tr><td>{_e(f)}</td><td class="num">{n}</td><td class="num">{_f(r)}</td><td class="num">{_f(c, 3)}</td>'
                   f'<td class="num">{_f(s)}</td><td class="num">{_f(z)}</td><td class="num">{_f(w)}</td></tr>'
                   for f, n, r, c, s, z, w in rows)
    return ('<h3>Families</h3><table class="data sortable" id="family-table"><thead><tr><th>family</th><th>domains</th>'
            '<th>reward (mean)</th><th>Δ reward</th><th>success</th><th>zero-var frac</th><th>weight (sum)</th></tr></thead>'
            f'<tbody>{body}</tbody></table>')


def _movers(run: RunData, k: int = 10) -> str:
    ch = [(d, c) for d in run.domains if (c := change(run, _k("reward/mean", d))) is not None]
    if not ch:
        return '<p class="note" id="movers-missing">No reward/mean/&lt;domain&gt; series with two or more steps.</p>'
    ch.sort(key=lambda x: x[1])
    fam = run.family_of

    def table(tid: str, items) -> str:
        return (f'<table class="data" id="{tid}"><thead><tr><th>domain</th><th>family</th><th>Δ reward</th><th>reward</th></tr></thead><tbody>'
                + "".join(f'<tr><td>{_e(d)}</td><td>{_e(fam.get(d, d))}</td><td class="num">{c:+.3f}</td>'
                          f'<td>{sparkline(run.series[_k("reward/mean", d)])}</td></tr>' for d, c in items) + "</tbody></table>")
    up = [x for x in reversed(ch) if x[1] > 0][:k]
    down = [x for x in ch if x[1] < 0][:k]
    return ('<h3>Top movers (reward, last 3 logged steps vs first 3)</h3><div class="grid2">'
            f'<div><b>up</b>{table("movers-up", up)}</div><div><b>down</b>{table("movers-down", down)}</div></div>')


def _domain_table(run: RunData) -> str:
    fam = run.family_of
    rows = []
    for d in run.domains:
        r, c = latest(run, _k("reward/mean", d)), change(run, _k("reward/mean", d))
        s, z, w = latest(run, _k("success/rate", d)), latest(run, _k("rollout/zero_var_frac", d)), latest(run, _k("sampler/weight", d))
        rows.append(f'<tr data-q="{_e((d + " " + fam.get(d, d)).lower())}"><td>{_e(d)}</td><td>{_e(fam.get(d, d))}</td>'
                    f'<td class="num">{_f(r)}</td><td class="num">{_f(c)}</td><td class="num">{_f(s)}</td>'
                    f'<td class="num">{_f(z)}</td><td class="num">{_f(w, 4)}</td>'
                    f'<td>{sparkline(run.series.get(_k("reward/mean", d), ()))}</td></tr>')
    return (f'<h3>All {len(run.domains)} domains</h3><p><label>Search <input id="domain-search" type="search" '
            'placeholder="domain or family"></label> <span id="domain-count"></span> · click a column header to sort</p>'
            '<table class="data sortable" id="domain-table"><thead><tr><th>domain</th><th>family</th><th>reward</th>'
            '<th>Δ reward</th><th>success</th><th>zero-var frac</th><th>weight</th><th>reward over steps</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def clustered_heatmap(run: RunData, diverging: Callable[[float, float], str]) -> str:
    """Expert load x domain, rows grouped by family (see the module docstring); '' without MoE load metrics."""
    found = run.moe_load
    doms = [d for d in run.domains if d in found]
    if not doms:
        return ""
    experts = sorted(set().union(*(found[d] for d in doms)))
    # a load of 0 (an expert the domain never uses) is a value, not a gap: only a missing series is NaN
    cells = [[latest(run, found[d][e]) if e in found[d] else None for e in experts] for d in doms]
    M = np.array([[np.nan if v is None else v for v in row] for row in cells], dtype=float)
    fam = run.family_of
    order = sorted(range(len(doms)), key=lambda i: (fam.get(doms[i], doms[i]),
                                                    int(np.nanargmax(M[i])) if np.isfinite(M[i]).any() else 0, doms[i]))
    ch = 3.0 if len(doms) > 150 else (8.0 if len(doms) > 40 else 16.0)
    cw = max(8.0, min(36.0, 560.0 / len(experts)))
    lw, top = 150, 20
    width, height = int(lw + cw * len(experts) + 10), int(top + ch * len(doms) + 10)
    out = [f'<svg class="chart heat" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="expert load by domain, grouped by family">']
    for j, e in enumerate(experts):
        out.append(f'<text class="tick" x="{lw + cw * (j + 0.5):.1f}" y="{top - 6}" text-anchor="middle">{e}</text>')
    prev, start = None, 0
    for r, i in enumerate(order + [None]):
        f = fam.get(doms[i], doms[i]) if i is not None else None
        if f != prev and prev is not None:  # label and rule for the family that just ended
            y0, y1 = top + ch * start, top + ch * r
            out.append(f'<text class="tick" x="{lw - 6}" y="{(y0 + y1) / 2 + 4:.1f}" text-anchor="end">{_e(prev)}</text>'
                       f'<line x1="{lw - 4}" x2="{width - 10}" y1="{y1:.1f}" y2="{y1:.1f}" stroke="#333" stroke-width="0.6"/>')
            start = r
        prev = f
        if i is None:
            break
        y = top + ch * r
        for j in range(len(experts)):
            v = float(M[i, j])
            out.append(f'<rect x="{lw + cw * j:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" fill="{diverging(v, 1.0)}">'
                       f'<title>{_e(doms[i])} / e{experts[j]}: {_f(v, 2)}</title></rect>')
    out.append("</svg>")
    return (f'<figure class="plot" id="plot-expert-domain-clustered" data-kind="heatmap" data-rows="{len(doms)}" '
            f'data-cols="{len(experts)}"><figcaption>Expert load × domain, grouped by family (latest step)</figcaption>'
            + "".join(out) + '<p class="note">One row per domain; families separated by rules. Load relative to uniform '
            '(1×); red: over-used, blue: under-used.</p></figure>')


_JS = """
(function(){
  var box = document.getElementById('domain-search'), table = document.getElementById('domain-table');
  function count(){ if (!table) { return; } var n = 0, rows = table.tBodies[0].rows;
    for (var i = 0; i < rows.length; i++) { if (rows[i].style.display !== 'none') { n++; } }
    document.getElementById('domain-count').textContent = n + ' shown'; }
  if (box && table) { box.addEventListener('input', function(){
    var q = box.value.toLowerCase(), rows = table.tBodies[0].rows;
    for (var i = 0; i < rows.length; i++) { rows[i].style.display = rows[i].getAttribute('data-q').indexOf(q) >= 0 ? '' : 'none'; }
    count(); }); count(); }
  var sortables = document.querySelectorAll('table.sortable');
  for (var t = 0; t < sortables.length; t++) { (function(tb){
    var ths = tb.tHead.rows[0].cells;
    for (var c = 0; c < ths.length; c++) { (function(col){ ths[col].style.cursor = 'pointer';
      ths[col].addEventListener('click', function(){
        var rows = Array.prototype.slice.call(tb.tBodies[0].rows), desc = tb.getAttribute('data-sort') === col + ':asc';
        function key(r){ var s = r.cells[col].textContent, x = parseFloat(s); return isNaN(x) ? s : x; }
        rows.sort(function(a, b){ var x = key(a), y = key(b), o = x < y ? -1 : (x > y ? 1 : 0); return desc ? -o : o; });
        for (var i = 0; i < rows.length; i++) { tb.tBodies[0].appendChild(rows[i]); }
        tb.setAttribute('data-sort', col + (desc ? ':desc' : ':asc')); }); })(c); }
  })(sortables[t]); }
})();
"""

CSS = "svg.spark polyline{fill:none;stroke:#4e79a7;stroke-width:1.3}#domain-table td{padding:1px 6px}"


def domains_section(run: RunData, diverging: Callable[[float, float], str]) -> str:
    if not run.domains:
        return '<p class="note">No domains in this run.</p>'
    return (_rollups(run) + _movers(run) + clustered_heatmap(run, diverging) + _domain_table(run)
            + f"<script>{_JS}</script>")
