"""rl/observe/sink.py: the progress-bar text and the JSONL the sink writes (wandb's copy: tests/rl/observe/test_report.py)."""
from __future__ import annotations

import json
import math

import pytest

from rl.observe.record import DomainInfo, RunRecord
from rl.observe.sink import MetricsSink, format_duration, progress_text, read_metrics
from rl.types import StepMetrics


def test_progress_text_shows_step_rewards_and_eta():
    vals = {"reward/mean/swe": 0.125, "reward/mean/cad": 0.41, "reward/mean/all": 0.3, "loss/total": 1.0}
    # 4 steps done in this process in 100 s -> 25 s/step; after step index 9 of 20, 10 left -> 250 s
    s = progress_text(9, 20, vals, elapsed_s=100.0, steps_done=4)
    assert s == "step 10/20 | reward cad 0.410 swe 0.125 | eta 4m10s"
    assert progress_text(19, 20, vals, elapsed_s=1.0, steps_done=1).endswith("eta 0s")
    assert progress_text(0, 5, {}, elapsed_s=0.0, steps_done=0) == "step 1/5 | eta ?"
    many = {f"reward/mean/d{i}": 0.0 for i in range(10)}
    assert "+2" in progress_text(0, 5, many, elapsed_s=1.0, steps_done=1, max_domains=8)
    with pytest.raises(ValueError, match="total_steps"):
        progress_text(0, 0, vals, elapsed_s=1.0, steps_done=1)


def test_progress_text_reads_the_domains_from_the_run_record():
    """The bar looks each record domain's `reward/mean/<domain>` up by its full name: a domain named like a
    stat ("max", "std") or holding "/" shows as itself, and a reward-looking key of no run domain is not shown."""
    rec = RunRecord(tuple(DomainInfo(d, d, d) for d in ("max", "std", "web/search", "cad", "idle")))
    vals = {"reward/mean/max": 0.5, "reward/mean/std": 0.25, "reward/mean/web/search": 0.75, "reward/mean/cad": 1.0,
            "reward/mean/all": 0.6, "reward/mean/ghost": 0.9, "episode/wall_s/max": 3.0, "reward/std/cad": 0.1}
    want = "step 3/10 | reward cad 1.000 max 0.500 std 0.250 web/search 0.750 | eta 14s"
    assert progress_text(2, 10, vals, elapsed_s=6.0, steps_done=3, domains=rec) == want
    assert progress_text(2, 10, vals, elapsed_s=6.0, steps_done=3, domains=rec.names) == want
    four = {"reward/mean/swe": 0.125, "reward/mean/cad": 0.41, "reward/mean/terminal": 0.5, "reward/mean/browse": 0.0,
            "reward/mean/all": 0.3, "loss/total": 1.0}
    doms = ("browse", "cad", "swe", "terminal")  # the 4-domain line is the same with and without the record
    assert (progress_text(9, 20, four, elapsed_s=100.0, steps_done=4, domains=doms)
            == progress_text(9, 20, four, elapsed_s=100.0, steps_done=4)
            == "step 10/20 | reward browse 0.000 cad 0.410 swe 0.125 terminal 0.500 | eta 4m10s")
    many = {f"reward/mean/d{i}": 0.0 for i in range(10)}
    assert progress_text(0, 5, many, elapsed_s=1.0, steps_done=1, domains=[f"d{i}" for i in range(12)]).count("+2") == 1


@pytest.mark.parametrize("s,want", [(0, "0s"), (45.4, "45s"), (192, "3m12s"), (3720, "1h02m"), (float("nan"), "?"), (-1, "?")])
def test_format_duration(s, want):
    assert format_duration(s) == want


def test_jsonl_rows_keep_steps_and_turn_non_finite_values_into_nulls(tmp_path):
    sink = MetricsSink(tmp_path, wandb_mode="disabled")
    sink.log(StepMetrics(step=0, values={"reward/mean/a": 0.5, "x": float("nan")}, samples=({"domain": "a", "reward": "1"},)))
    sink.log(StepMetrics(step=1, values={"reward/mean/a": 0.75, "x": float("inf")}))
    sink.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and [r["reward/mean/a"] for r in rows] == [0.5, 0.75]
    assert rows[0]["x"] is None and rows[1]["x"] is None
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 0, "domain": "a", "reward": "1"}]
    assert read_metrics(tmp_path / "nowhere") == []
