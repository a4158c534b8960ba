"""rl/observe/report_data.py: what `load_run` reads from a run directory (resumed steps, torn lines, NaN
gaps, the run record's domains instead of names guessed from metrics, MoE names indexed once)."""
from __future__ import annotations

import re

from rl.observe import report
from rl.observe.sink import MetricsSink
from rl.types import StepMetrics


def test_resumed_steps_and_a_torn_last_line(tmp_path):
    sink = MetricsSink(tmp_path, wandb_mode="disabled")
    for s, v in ((0, 0.1), (1, 0.2), (1, 0.9), (2, 0.3)):  # step 1 redone after a resume
        sink.log(StepMetrics(step=s, values={"reward/mean/a": v}))
    sink.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')  # killed mid-write
    run = report.load_run(tmp_path)
    assert run.steps == (0, 1, 2) and run.series["reward/mean/a"] == (0.1, 0.9, 0.3)
    assert any("incomplete last line" in w for w in run.warnings)
    assert "incomplete last line" in report.render_report(run)


def test_nan_metrics_become_gaps(tmp_path):
    sink = MetricsSink(tmp_path, wandb_mode="disabled")
    for s, v in enumerate((0.1, float("nan"), 0.3)):
        sink.log(StepMetrics(step=s, values={"reward/mean/a": v}))
    sink.close()
    page = report.render_report(report.load_run(tmp_path))
    fig = page[page.index('id="plot-reward-mean"'):page.index('id="plot-success-rate"')]
    paths = re.findall(r'<path class="line" d="([^"]+)"', fig)
    assert len(paths) == 2 and not any(" L" in d for d in paths)  # the NaN step splits the line; no bridge over it
    assert len(re.findall(r"<circle", fig)) == 2


def test_domains_come_from_the_run_record_not_metric_names(tmp_path):
    from rl.observe.record import DomainInfo, RunRecord, read_run_record, write_run_record

    sink = MetricsSink(tmp_path, wandb_mode="disabled")
    sink.log(StepMetrics(step=0, values={"reward/mean/terminal": 0.5, "reward/mean/all": 0.5, "episode/wall_s/max": 3.0,
                                         "tokens/response/mean": 9.0, "moe/load_e000/terminal": 1.0}))
    sink.close()
    # Without a record (older runs): only domains with a reward/mean/<domain> series, never stat names.
    assert report.load_run(tmp_path).domains == ("terminal",)
    rec = RunRecord((DomainInfo("terminal", "terminal-v0", "terminal"), DomainInfo("rg-gcd-v0", "rg-gcd-v0", "arithmetic")),
                    steps=9)
    write_run_record(tmp_path, rec)
    assert read_run_record(tmp_path) == rec
    run = report.load_run(tmp_path)
    assert run.domains == ("rg-gcd-v0", "terminal") and run.families == {"arithmetic": ("rg-gcd-v0",), "terminal": ("terminal",)}
    assert run.planned_steps == 9 and "1 of 9 planned" in report.render_report(run)
    # MoE names are indexed once by the loader: the charts look them up by domain and expert
    assert run.moe_load == {"terminal": {0: "moe/load_e000/terminal"}} and run.moe_max_vio == {}
    (tmp_path / "run.json").write_text('{"domains": [{"name": 3}]}')
    run = report.load_run(tmp_path)
    assert run.domains == ("terminal",) and any("run.json" in w or "run record" in w for w in run.warnings)
