"""rl/observe/sink.py: the progress-bar text and the JSONL the sink writes (wandb's copy: tests/rl/observe/test_report.py)."""
from __future__ import annotations

import json
import math

import pytest

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
