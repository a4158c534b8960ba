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


def test_a_run_stopped_in_the_control_arm_reports_its_two_arms(tmp_path, capsys):
    import json

    from rl.evaluate import EvalRow, paired_diff

    before = [0.0, 0.5, 0.5, 1.0, 0.0, 0.5, 0.0, 1.0]
    after = [0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.0, 1.0]

    def rows(ts):
        return [EvalRow(domain="terminal_basics", tier="low", n=len(ts), success=sum(ts) / len(ts), reward=0.0, tokens=60.0,
                        turns=2.0, samples=2, task_success=tuple(ts)).__dict__]

    (tmp_path / "eval_before.json").write_text(json.dumps(rows(before)))
    (tmp_path / "eval_after.json").write_text(json.dumps(rows(after)))
    (tmp_path / "config.json").write_text(json.dumps({"envs": {"env_ids": {"terminal_basics": "terminal-basics-v0"}}}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(_row(i, 300.0, 100.0, 200.0)) for i in range(2)) + "\n")
    assert lr.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "eval.json absent" in out and "RL wall time: 10.0 min" in out
    line = [ln for ln in out.splitlines() if ln.startswith("terminal-basics-v0")][0].split()
    want = paired_diff(before, after)
    assert line[6] == "-"  # no control arm
    assert float(line[7]) == pytest.approx(want.mean, abs=5e-4) and float(line[8]) == pytest.approx(want.t, abs=5e-3)
    assert float(line[-1]) == pytest.approx(100 * want.mean, abs=5e-3)  # points per 10 minutes: RL ran 10 minutes
    assert not (tmp_path / "eval.json").exists()  # the contract file of a finished run is not forged
    assert lr.main([str(tmp_path / "missing")]) == 2


def _write_arms(run, arms, n_tasks=None):
    import json

    from rl.evaluate import EvalRow

    run.mkdir()
    for arm, ts in arms.items():
        row = EvalRow(domain="terminal_basics", tier="low", n=len(ts), success=sum(ts) / len(ts), reward=0.0, tokens=60.0,
                      turns=2.0, samples=2, task_success=tuple(ts))
        (run / f"eval_{arm}.json").write_text(json.dumps([row.__dict__]))
    (run / "config.json").write_text(json.dumps({"envs": {"env_ids": {"terminal_basics": "terminal-basics-v0"}}}))


def test_against_pairs_each_arm_with_the_other_runs_by_task(tmp_path, capsys):
    from rl.evaluate import paired_diff

    before = [0.0, 0.5, 0.5, 1.0, 0.0, 0.5]
    base_after = [0.5, 0.5, 0.5, 1.0, 0.0, 1.0]
    knob_after = [1.0, 1.0, 0.5, 1.0, 0.5, 1.0]
    _write_arms(tmp_path / "base", {"before": before, "after": base_after})
    _write_arms(tmp_path / "knob", {"before": before, "after": knob_after})
    assert lr.main([str(tmp_path / "knob"), "--against", str(tmp_path / "base")]) == 0
    lines = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()
             if ln.split() and ln.split()[0] in lr.ARMS}
    assert set(lines) == {"before", "after"}  # the control arm is in neither run
    assert float(lines["before"][6]) == 0.0  # the same SFT start
    want = paired_diff(base_after, knob_after)
    assert float(lines["after"][4]) == pytest.approx(sum(knob_after) / 6, abs=5e-4)
    assert float(lines["after"][6]) == pytest.approx(want.mean, abs=5e-4)
    assert float(lines["after"][-1]) == pytest.approx(want.t, abs=5e-3)


def test_against_refuses_runs_of_different_task_counts(tmp_path, capsys):
    _write_arms(tmp_path / "a", {"before": [0.0, 1.0, 0.5], "after": [1.0, 1.0, 0.5]})
    _write_arms(tmp_path / "b", {"before": [0.0, 1.0], "after": [1.0, 1.0]})
    assert lr.main([str(tmp_path / "a"), "--against", str(tmp_path / "b")]) == 2
    assert "3 held-out tasks here, 2 in" in capsys.readouterr().err
