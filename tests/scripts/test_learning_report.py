"""scripts/learning_report.py: the step-time means and points-per-10-minutes it prints, from fixed records."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("learning_report", Path(__file__).resolve().parents[2] / "scripts" / "learning_report.py")
lr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lr)


def _row(step, s, gen, train):
    return {"step": step, "time/step_s": s, "time/rollout_generate_s": gen, "time/train_s": train}


def test_breakdown_skips_warm_up_steps_and_averages_the_rest():
    rows = [_row(0, 100.0, 90.0, 10.0), _row(1, 30.0, 10.0, 20.0), _row(2, 50.0, 20.0, 30.0)]
    b = lr.step_breakdown(rows, skip=1)
    assert b["steps"] == 2 and b["step_s"] == pytest.approx(40.0)
    assert b["rollout_generate_s"] == pytest.approx(15.0) and b["train_s"] == pytest.approx(25.0) and b["sync_s"] == 0.0


def test_points_per_ten_minutes_use_rl_wall_time():
    doc = {"rl_seconds": 1200.0, "domains": {"terminal-basics-v0": {
        "n": 120, "success_before": 0.3, "success_after": 0.45, "ci95_before": [0.25, 0.35], "ci95_after": [0.4, 0.5],
        "paired_t": 4.1, "gain": 0.15}}}
    text = lr.format_report(doc, [], skip=0)
    line = [ln for ln in text.splitlines() if ln.startswith("terminal-basics-v0")][0]
    assert line.split()[-1] == "7.50"  # 15 points over 20 minutes
    assert lr.rl_seconds({}, [_row(0, 30.0, 0, 0), _row(1, 45.0, 0, 0)]) == 75.0
