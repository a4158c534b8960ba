"""`jointrl report RUN_DIR [--out FILE]`: one self-contained HTML page of a run, readable without wandb.

Reads what the run directory always has — `metrics.jsonl` (one row per step, names `<family>/<stat>/<domain>`),
`samples.jsonl` (rollout samples), and when present `config.json` and `eval_<label>.json` — and writes a single
HTML file: inline CSS, inline SVG plots drawn here in Python, a few lines of inline JS (sample filter, legend
toggles). No CDN or network: the page opens from a laptop or a cluster's shared disk alike.

Sections: per-domain reward (mean ± std band) and success curves; token / thinking-token / turn distributions
(box plots of the latest step from the quantiles rl/observe/telemetry.py writes, and medians with p25-p75 bands over
time); rollout health (truncation, tool errors, zero-variance groups, sampling weights); policy (each loss term,
clip fractions, grad norm, entropy estimate, staleness); the train/inference logprob gap over time; MoE (expert
load x domain heatmap, max violation per layer x domain, router entropy, aux/z, replay mismatch,
expert-domain mutual information); the latest samples; held-out evals; every metric's latest value.
A plot whose metrics are absent from the run is replaced by a note naming the keys it looked for.

Reading the run directory is rl/observe/report_data.py, the chart primitives rl/observe/svg.py, the sections that
stay readable at hundreds of domains rl/observe/report_domains.py.
What it does not do: compute metrics (rl/observe/telemetry.py, rl/observe/moe.py, the objective do), or read wandb.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from rl.observe import names, report_domains, report_eval
from rl.observe.report_data import ReportError, RunData, load_run
from rl.observe.svg import (ALL_COLOR, PALETTE, Box, Series, box_plot, diverging, esc, fmt, heatmap, line_chart,
                            missing)

__all__ = ["ReportError", "RunData", "load_run", "render_report", "write_report", "main"]


class _Ctx:
    """Per-report helpers: consistent domain colours and series lookup."""

    def __init__(self, run: RunData) -> None:
        self.run = run
        labels = list(run.families) if run.many else list(run.domains)
        self.colors = {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(labels)}
        self.xs = [float(s) + 1 for s in run.steps]  # 1-based, as the console counts steps

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
            return missing(pid, title, f"no '{prefix}/<domain>' metrics")
        return line_chart(pid, title, self.xs, s, ylabel=ylabel, yrange=yrange)

    def keys_chart(self, pid: str, title: str, keys: Sequence[str], ylabel: str = "", yrange=None) -> str:
        s = self.key_series(keys)
        if not s:
            return missing(pid, title, "none of " + ", ".join(keys))
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
        return missing("loss-terms", "Loss terms", "none of " + ", ".join(_LOSS_KEYS))
    # One small chart per term: they live on very different scales.
    inner = "".join(line_chart("loss-" + re.sub(r"[^a-z0-9]+", "-", k.lower()), k, c.xs,
                               [Series(k, c.run.series[k], PALETTE[i % len(PALETTE)])], width=360, height=200)
                    for i, k in enumerate(present))
    return f'<div class="plot-group" id="plot-loss-terms" data-kind="group" data-count="{len(present)}">{inner}</div>'


def _moe_heatmaps(c: _Ctx) -> str:
    run = c.run
    load = run.moe_load
    if not load:
        hm = missing("expert-domain-heatmap", "Expert load × domain", "no 'moe/load_e<expert>/<domain>' metrics (rl/observe/moe.py)")
    else:
        if run.many:  # per-domain rows are in the Domains section's family-grouped map
            return missing("expert-domain-heatmap", "Expert load × domain",
                           f"{len(run.domains)} domains: see the family-grouped map in the Domains section")
        rows = [d for d in run.domains if d in load] + ([names.ALL] if names.ALL in load else [])
        experts = sorted({e for d in rows for e in load[d]})
        keys = [load[d][e] for d in rows for e in experts if e in load[d]]
        i = run.last_step_with(keys)
        # Average over the last few logged steps: one step's batch is small and noisy.
        idx = [j for j in range(len(run.steps)) if any(run.series[k][j] is not None for k in keys)][-5:]
        M = np.full((len(rows), len(experts)), np.nan)
        for r, d in enumerate(rows):
            for col, e in enumerate(experts):
                k = load[d].get(e)
                vals = [] if k is None else [run.series[k][j] for j in idx if run.series[k][j] is not None]
                if vals:
                    M[r, col] = float(np.mean(vals))
        note = (f"Load = share of a domain's routing assignments that went to the expert, relative to uniform (1×), "
                f"averaged over MoE layers and over steps {run.steps[idx[0]] + 1}–{run.steps[i] + 1} ({len(idx)} logged steps). "
                "Red: the domain over-uses the expert; blue: under-uses it.")
        hm = heatmap("expert-domain-heatmap", "Expert load × domain", rows, [str(e) for e in experts], M, note=note)
    # per-layer max violation x domain at the latest step
    vio = run.moe_max_vio
    rows = [d for d in run.domains if d in vio] + ([names.ALL] if names.ALL in vio else [])
    if rows:
        layers = sorted({l for d in rows for l in vio[d]})
        i = run.last_step_with([vio[d][l] for d in rows for l in layers if l in vio[d]])
        M = np.full((len(rows), len(layers)), np.nan)
        for r, d in enumerate(rows):
            for col, l in enumerate(layers):
                v = run.series[vio[d][l]][i] if l in vio[d] else None
                M[r, col] = np.nan if v is None else v
        # MaxVio 0 = balanced: show 1 + MaxVio (the busiest expert's load) on the same 1x-centred scale.
        hv = heatmap("maxvio-layer-heatmap", f"Busiest expert's load (1 + MaxVio) per MoE layer × domain, step {run.steps[i] + 1}",
                     rows, [f"L{l}" for l in layers], 1.0 + M,
                     note="MaxVio (Wang et al. 2024, arXiv:2408.15664) = max load / mean load − 1 per layer; 1× = perfectly balanced.")
    else:
        hv = missing("maxvio-layer-heatmap", "Max violation per layer × domain", "no 'moe/max_vio_l<layer>/<domain>' metrics")
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
        extra_txt = "".join(f"<div><b>{esc(k)}</b>: {esc(v)}</div>" for k, v in sorted(extra.items()))
        step = s.get("step")
        rows.append(f'<tr data-domain="{esc(d)}"><td>{esc(step + 1 if isinstance(step, int) else "")}</td>'
                    f'<td><i class="dot" style="background:{ctx.color(d)}"></i>{esc(d)}</td><td>{esc(s.get("task_id", ""))}</td>'
                    f'<td class="num">{esc(s.get("reward", ""))}</td><td class="num">{esc(s.get("turns", ""))}</td>'
                    f'<td><details><summary>{len(transcript)} chars</summary>{extra_txt}<pre>{esc(transcript)}</pre></details></td></tr>')
    doms = sorted(per)
    opts = '<option value="">all domains</option>' + "".join(f'<option value="{esc(d)}">{esc(d)}</option>' for d in doms)
    return (f'<p>Samples from step {last_step + 1} (up to {limit_per_domain} per domain). '
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
                                        f'{esc(fmt(r[c]) if isinstance(r.get(c), float) else r.get(c, ""))}</td>' for c in cols) + "</tr>"
                       for r in rows)
        out.append(f'<h3>{esc(label)}</h3><table class="data eval" data-label="{esc(label)}"><thead><tr>'
                   + "".join(f"<th>{esc(c)}</th>" for c in cols) + f"</tr></thead><tbody>{body}</tbody></table>")
    return f'<details id="eval-raw"><summary>each arm\'s rows (eval_&lt;label&gt;.json)</summary>{"".join(out)}</details>'



def _summary(run: RunData, c: _Ctx) -> str:
    t = [x for x in run.times if x is not None]
    dur = (t[-1] - t[0]) if len(t) >= 2 else None
    planned = f" of {run.planned_steps} planned" if run.planned_steps is not None else ""
    cards = [("steps logged", f"{len(run.steps)}{planned}"), ("last step", str(run.steps[-1] + 1) if run.steps else "–"),
             ("domains", (f"{len(run.domains)} in {len(run.families)} families" if run.many else ", ".join(run.domains)) or "–"),
             ("wall time", f"{dur / 60:.1f} min" if dur is not None else "–")]
    for d in ([] if run.many else run.domains):
        r, s = run.last(f"reward/mean/{d}"), run.last(f"success/rate/{d}")
        cards.append((f"{d}: reward / success", f"{fmt(r)} / {fmt(s)}"))
    html_cards = "".join(f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div></div>' for k, v in cards)
    cfg = ""
    if run.config:
        cfg = f'<details><summary>run config</summary><pre>{esc(json.dumps(run.config, indent=2, default=str))}</pre></details>'
    warn = "".join(f'<p class="warn">{esc(w)}</p>' for w in run.warnings)
    return f'<div class="cards">{html_cards}</div>{warn}{cfg}'


def _all_metrics(run: RunData) -> str:
    rows = []
    doms = set(run.domains) if run.many else set()  # per-domain values are in the Domains section's table
    for k in sorted(run.series):
        if doms and (sd := names.split_domain(k, doms)) is not None and sd[1] != names.ALL:
            continue
        vals = [v for v in run.series[k] if v is not None]
        if not vals:
            continue
        rows.append(f"<tr><td>{esc(k)}</td><td class=num>{esc(fmt(vals[-1]))}</td><td class=num>{esc(fmt(min(vals)))}</td>"
                    f"<td class=num>{esc(fmt(max(vals)))}</td><td class=num>{len(vals)}</td></tr>")
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
        body = ('<p class="note">No RL step logged yet (metrics.jsonl has no rows).</p>' if run.sft else
                '<p class="warn">metrics.jsonl has no rows yet: nothing to plot.</p>')
        sections = [("Summary", "summary", _summary(run, c) + body)]
        if run.sft:
            sections.append(("Supervised fine-tuning", "sft", report_eval.sft_section(run)))
        if run.evals:
            sections.append(("Held-out evaluation", "eval", report_eval.heldout_section(run) + _eval_tables(run)))
    else:
        rates = (0.0, 1.0)
        tok_boxes, ti = c.latest_boxes("tokens/response")
        think_boxes, hi = c.latest_boxes("tokens/thinking")
        turn_boxes, ui = c.latest_boxes("turns/n")

        def boxes(pid: str, title: str, b: list[Box], i: int | None, ylabel: str) -> str:
            if not b:
                return missing(pid, title, "no per-domain quantiles (rl/telemetry.py writes <metric>_p25/<domain> etc.)")
            return box_plot(pid, f"{title}, step {run.steps[i] + 1}", b, ylabel=ylabel,
                            note="Box: p25–p75 with the median; whiskers: min–max; short ticks: p10 / p90.")

        sections = [
            ("Summary", "summary", _summary(run, c)),
            ("Supervised fine-tuning", "sft", report_eval.sft_section(run)),
            ("Held-out evaluation", "eval", report_eval.heldout_section(run) + _eval_tables(run)),
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
            ("Domains", "domains", report_domains.domains_section(run, diverging)),
            ("Latest samples", "samples", _samples_table(run, c)),
            ("All metrics", "metrics", _all_metrics(run)),
        ]
    nav = "".join(f'<a href="#sec-{sid}">{esc(title)}</a>' for title, sid, _ in sections)
    body = "".join(f'<section id="sec-{sid}"><h2>{esc(title)}</h2>{content}</section>' for title, sid, content in sections)
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>jointrl report — {esc(run.name)}</title>"
            f"<style>{_CSS}{report_domains.CSS}</style></head><body><header><h1>jointrl report — {esc(run.name)}</h1>"
            f"<div class=\"sub\">{esc(run.run_dir)} · generated {generated}</div></header><nav>{nav}</nav><main>{body}</main>"
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
