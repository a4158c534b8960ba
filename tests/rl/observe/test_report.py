"""`jointrl report`: the HTML page built from a run directory written through the real MetricsSink.

Checks the page's content against metrics.jsonl read independently here (plotted points, heatmap cells,
box-plot quantiles), that it is self-contained and escapes transcripts, that bad run directories give
clear errors, and renders it in headless Chromium: every plot laid out, no console errors.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.rl.observe.dash_chromium import find_chromium, load_page
from tests.rl.observe.dash_html import Figures
from tests.rl.observe.dash_synth import DOMAINS, EVIL, build_run
from rl.observe import report
from rl.observe.sink import MetricsSink
from rl.types import StepMetrics

STEPS = 8
# Plots that must carry data for a run with rollout, policy, gap and MoE metrics.
REQUIRED = ("reward-mean", "success-rate", "zero-var", "sampler-weight", "tokens-response-box", "tokens-thinking-box", "turns-box",
            "tokens-response-median", "turns-mean", "truncated", "tool-errors", "loss-pg-loss", "loss-kl-value",
            "loss-router-aux-loss", "loss-loss-total", "grad-norm", "entropy", "logprob-gap", "gap-kl",
            "expert-domain-heatmap", "maxvio-layer-heatmap", "max-vio", "router-entropy", "moe-aux", "moe-z", "replay-mismatch")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rd = build_run(tmp_path_factory.mktemp("run") / "r", steps=STEPS)
    out = report.write_report(rd)
    rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    page = out.read_text()
    p = Figures()
    p.feed(page)
    return rd, out, rows, page, p


def test_every_plot_is_present_with_data(run):
    _, _, _, _, p = run
    missing = [pid for pid in REQUIRED if p.kind.get(pid) in (None, "missing")]
    assert not missing, f"plots without data: {missing}"
    assert p.attrs_of["reward-mean"]["data-series-count"] == str(len(DOMAINS) + 1)  # each domain + all


def test_plotted_points_are_the_logged_values(run):
    _, _, rows, _, p = run
    pts = {}
    for cy, t in p.circles["reward-mean"]:
        m = re.match(r"(\w+) @ step (\d+): (\S+)", t)
        pts[(m.group(1), int(m.group(2)))] = (float(m.group(3)), cy)
    for r in rows:
        for d in DOMAINS:
            v, _ = pts[(d, r["step"] + 1)]  # the report counts steps from 1, like the console
            assert v == pytest.approx(r[f"reward/mean/{d}"], rel=1e-3, abs=1e-9)
    # larger values are drawn higher (smaller SVG y) on the shared axis
    vals = sorted(pts.values())
    assert all(a[1] >= b[1] - 1e-6 for a, b in zip(vals, vals[1:]))


def test_heatmap_cells_are_layer_averaged_loads_over_the_last_steps(run):
    _, _, rows, _, p = run
    cells = {}
    for t in p.titles["expert-domain-heatmap"]:
        m = re.match(r"(\w+) / (\d+): (\S+)", t)
        cells[(m.group(1), int(m.group(2)))] = float(m.group(3))
    assert len(cells) == (len(DOMAINS) + 1) * 8
    for (d, e), v in cells.items():
        want = np.mean([r[f"moe/load_e{e:03d}/{d}"] for r in rows[-5:]])
        assert v == pytest.approx(want, rel=1e-3)
    # the synthetic routers prefer experts 2d and 2d+1 for domain d: the heatmap must show that affinity
    for di, d in enumerate(DOMAINS):
        assert cells[(d, 2 * di)] > 1.5 and cells[(d, (2 * di + 4) % 8)] < 1.0


def test_box_plots_use_the_latest_steps_quantiles(run):
    _, _, rows, _, p = run
    last = rows[-1]
    assert p.titles["tokens-response-box"], "no box tooltips"
    for t in p.titles["tokens-response-box"]:
        d = t.split(":")[0]
        got = dict(re.findall(r"(min|p10|p25|p50|p75|p90|max) (\S+?)(?:,|$)", t))
        for q in ("min", "p25", "p50", "p75", "max"):
            assert float(got[q]) == pytest.approx(last[f"tokens/response_{q}/{d}"], rel=1e-3)


def test_page_is_self_contained_and_escapes_transcripts(run):
    _, _, _, page, p = run
    assert not p.external, p.external
    assert "@import" not in page and "url(" not in page
    assert EVIL not in page  # the raw <script> from a transcript never reaches the page
    assert "&lt;script&gt;console.error(&#x27;injected&#x27;)&lt;/script&gt;" in page
    assert set(p.sample_rows) == {"cad", "swe", "terminal"}
    assert f"Samples from step {STEPS}" in page  # the last step, counted from 1


@pytest.mark.parametrize("setup,msg", [
    (lambda d: d / "nope", "does not exist"),
    (lambda d: d, "metrics.jsonl not found"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n') and d, "line 2 is not valid JSON"),
    (lambda d: (d / "metrics.jsonl").write_text('{"time": 1}\n') and d, "no integer 'step'"),
    (lambda d: (d / "metrics.jsonl").write_text('[1, 2]\n{"step": 1}\n') and d, "line 1 is a list"),
])
def test_bad_run_dirs_give_clear_errors(tmp_path, capsys, setup, msg):
    rd = setup(tmp_path)
    assert report.main(str(rd), None) == 2
    err = capsys.readouterr().err
    assert err.startswith("jointrl report: ") and msg in err


def test_out_must_be_a_file(run, tmp_path, capsys):
    rd = run[0]
    assert report.main(str(rd), str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err


def test_cli_writes_the_report(run, tmp_path):
    from rl.cli import main as cli

    out = tmp_path / "sub" / "r.html"
    assert cli(["report", str(run[0]), "--out", str(out)]) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")


def test_empty_run_renders_a_notice(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    out = report.write_report(tmp_path)
    assert "no rows yet" in out.read_text()


PROBE = """(function(){
  var out = {figures: {}, legendToggle: null, ready: document.body.getAttribute('data-report-ready')};
  document.querySelectorAll('figure.plot').forEach(function(f){
    var s = f.querySelector('svg'); if (!s) { out.figures[f.id.slice(5)] = null; return; }
    var b = s.getBoundingClientRect();
    var drawn = 0;
    s.querySelectorAll('path.line, circle, rect.cell, rect.iqr').forEach(function(e){
      var r = e.getBoundingClientRect(); if (r.width > 0 || r.height > 0) drawn++; });
    out.figures[f.id.slice(5)] = {w: b.width, h: b.height, drawn: drawn};
  });
  var lg = document.querySelector('#plot-reward-mean .lg[data-series="0"]');
  lg.click();
  var g = document.querySelector('#plot-reward-mean g.series[data-series="0"]');
  out.legendToggle = getComputedStyle(g).display;
  var sel = document.getElementById('sample-filter'); sel.value = 'swe'; sel.dispatchEvent(new Event('change'));
  var shown = []; document.querySelectorAll('#samples tbody tr').forEach(function(r){ if (r.style.display !== 'none') shown.push(r.getAttribute('data-domain')); });
  out.shownDomains = shown;
  return out; })()"""


@pytest.mark.skipif(find_chromium() is None, reason="Debian's chromium package is not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium_without_console_errors(run):
    res = load_page(run[1], PROBE)
    assert res.console_errors == (), res.console_errors
    assert 'id="plot-expert-domain-heatmap"' in res.dom
    if res.mode != "cdp":
        pytest.skip("websockets is not installed: console checked via --dump-dom logs, layout probe not run")
    figs = res.probe["figures"]
    for pid in REQUIRED:
        if pid.startswith("loss-"):
            continue  # checked below inside the loss group
        f = figs[pid]
        assert f and f["w"] > 100 and f["h"] > 100 and f["drawn"] > 0, (pid, f)
    assert all(figs[k]["drawn"] > 0 for k in figs if k.startswith("loss-") and figs[k])
    assert int(res.probe["ready"]) >= len(REQUIRED)
    assert res.probe["legendToggle"] == "none"  # legend click hides the series
    assert set(res.probe["shownDomains"]) == {"swe"}


@pytest.mark.skipif(find_chromium() is None, reason="Debian's chromium package is not installed (apt-get install -y chromium)")
def test_the_chromium_check_does_catch_console_errors(tmp_path):
    """Negative control: the same loader flags a page with a script error and a console.error."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>console.error('boom'); undefinedFunction();</script></body></html>")
    errs = load_page(bad).console_errors
    assert len(errs) >= 2 and any("boom" in e for e in errs)


@pytest.mark.slow
def test_wandb_offline_run_gets_metrics_and_sample_tables(tmp_path):
    """wandb offline (the default): one local run per sink, samples as tables with transcript and reward."""
    build_run(tmp_path, steps=2, wandb_mode="offline")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = sorted(runs[0].glob("files/media/table/samples_*.table.json"))
    assert len(tables) == 2
    t = json.loads(tables[0].read_text())
    cols = t["columns"]
    assert {"domain", "reward", "transcript", "task_id"} <= set(cols)
    assert {row[cols.index("domain")] for row in t["data"]} == set(DOMAINS)


def test_batch_wide_keys_join_the_per_domain_chart(tmp_path):
    sink = MetricsSink(tmp_path, wandb_mode="disabled")
    for s in range(3):  # the async driver logs one batch-wide staleness, no per-domain one
        sink.log(StepMetrics(step=s, values={"policy/staleness": float(s % 2), "reward/mean/a": 0.5}))
    sink.close()
    p = Figures()
    p.feed(report.render_report(report.load_run(tmp_path)))
    assert p.kind["staleness"] == "line"
    assert [t.split(" @")[0] for t in p.titles["staleness"]] == ["policy/staleness"] * 3


# ---------------------------------------------------------------------------------------------- many domains
