"""The paired comparison behind the held-out before/after table, against the formula and scipy's own paired test."""
from __future__ import annotations

import math

import numpy as np
import pytest

import json

from rl.evaluate import EvalRow, format_eval_table, mean_ci, paired_diff, tasks_to_resolve, write_eval_json


def _slow_paired(before, after):
    d = [a - b for a, b in zip(after, before)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, mean / math.sqrt(var / n)


def test_paired_diff_matches_the_formula_and_scipy():
    from scipy.stats import ttest_rel

    rng = np.random.default_rng(0)
    before = rng.integers(0, 2, 60).astype(float)
    after = np.clip(before + rng.integers(0, 2, 60) * (rng.random(60) < 0.4), 0, 1)
    p = paired_diff(before, after)
    mean, t = _slow_paired(list(before), list(after))
    assert p.n == 60 and p.mean == pytest.approx(mean) and p.t == pytest.approx(t)
    assert p.t == pytest.approx(ttest_rel(after, before).statistic)
    # the interval is mean +- t_{0.975, n-1} * se, and contains the mean
    se = np.std(after - before, ddof=1) / math.sqrt(60)
    assert p.ci_high - p.mean == pytest.approx(2.000995 * se, rel=1e-4)  # t quantile at 59 d.o.f.
    assert p.ci_low < p.mean < p.ci_high


def test_paired_diff_edge_cases():
    assert paired_diff([0, 0, 0, 0], [1, 1, 1, 1]).t == math.inf
    assert paired_diff([0, 1, 0, 1], [0, 1, 0, 1]).t == 0.0
    # d = [1, 0, 1, 0]: mean 0.5, sample sd sqrt(1/3), t = 0.5 / sqrt(1/12) = sqrt(3)
    assert paired_diff([0, 0, 0, 0], [1, 0, 1, 0]).t == pytest.approx(math.sqrt(3))
    with pytest.raises(ValueError, match="same tasks"):
        paired_diff([0, 1], [1])


def test_table_shows_paired_gain_ci_and_t():
    b = EvalRow("terminal", "low", 4, 0.25, 0.25, 10.0, 1.0, task_success=(0.0, 0.0, 1.0, 0.0))
    a = EvalRow("terminal", "low", 4, 0.75, 0.75, 10.0, 1.0, task_success=(1.0, 1.0, 1.0, 0.0))
    row = format_eval_table([b], [a]).splitlines()[-1]
    p = paired_diff(b.task_success, a.task_success)
    assert f"{p.mean:+.3f}" in row and f"{p.t:.2f}" in row and f"{p.ci_low:+.3f}" in row
    unpaired = format_eval_table([b], [EvalRow("terminal", "low", 4, 0.5, 0.5, 10.0, 1.0)]).splitlines()[-1]
    assert "(unpaired)" in unpaired and "+0.250" in unpaired


def test_mean_ci_matches_scipy_t_interval():
    from scipy import stats

    x = np.array([0, 0.5, 1, 1, 0, 0.5, 1, 0, 0, 1], dtype=float)
    lo, hi = mean_ci(x)
    ref = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    assert (lo, hi) == pytest.approx(ref)
    assert mean_ci([1.0]) == (-math.inf, math.inf)


def test_tasks_to_resolve_reaches_the_asked_t():
    # n = (t sd / gain)^2: sd 0.45, gain 0.1, t 3 -> 182.25 -> 183; at that n, gain / (sd / sqrt(n)) >= 3
    n = tasks_to_resolve(0.45, 0.10, t=3.0)
    assert n == 183
    assert 0.10 / (0.45 / math.sqrt(n)) >= 3.0 > 0.10 / (0.45 / math.sqrt(n - 1))
    with pytest.raises(ValueError, match="gain"):
        tasks_to_resolve(0.4, 0.0)


def test_eval_json_has_the_contract_keys_per_environment_id(tmp_path):
    b = EvalRow("terminal", "low", 4, 0.25, 0.25, 10.0, 1.0, samples=2, task_success=(0.0, 0.5, 0.5, 0.0))
    a = EvalRow("terminal", "low", 4, 0.625, 0.7, 10.0, 1.0, samples=2, task_success=(0.5, 1.0, 0.5, 0.5))
    c = EvalRow("terminal", "low", 4, 0.25, 0.25, 10.0, 1.0, samples=2, task_success=(0.0, 0.5, 0.0, 0.5))
    doc = write_eval_json(tmp_path / "eval.json", {"terminal": "terminal-basics-v0"}, [b], [a], [c], rl_seconds=300.0)
    assert json.loads((tmp_path / "eval.json").read_text()) == doc
    e = doc["domains"]["terminal-basics-v0"]
    for k in ("n", "success_before", "success_after", "ci95_before", "ci95_after", "paired_t"):
        assert k in e
    p = paired_diff(b.task_success, a.task_success)
    assert e["n"] == 4 and e["success_before"] == 0.25 and e["success_after"] == 0.625
    assert e["paired_t"] == pytest.approx(p.t) and e["ci95_after"] == pytest.approx(list(mean_ci(a.task_success)))
    assert e["success_sft_control"] == 0.25
    assert doc["rl_seconds"] == 300.0 and e["points_per_10min"] == pytest.approx(100 * p.mean * 2)  # 5 min of RL
    assert e["paired_t_rl_vs_sft_control"] == pytest.approx(paired_diff(c.task_success, a.task_success).t)
    # an undefined t (zero spread) is written as null, never as Infinity (invalid JSON)
    z = EvalRow("terminal", "low", 2, 0.0, 0.0, 1.0, 1.0, task_success=(0.0, 0.0))
    o = EvalRow("terminal", "low", 2, 1.0, 1.0, 1.0, 1.0, task_success=(1.0, 1.0))
    doc = write_eval_json(tmp_path / "e2.json", {}, [z], [o])
    assert doc["domains"]["terminal"]["paired_t"] is None
    assert "Infinity" not in (tmp_path / "e2.json").read_text()


def test_table_shows_the_sft_control_arm():
    b = EvalRow("terminal", "low", 4, 0.25, 0.25, 10.0, 1.0, task_success=(0.0, 0.0, 1.0, 0.0))
    a = EvalRow("terminal", "low", 4, 0.75, 0.75, 10.0, 1.0, task_success=(1.0, 1.0, 1.0, 0.0))
    c = EvalRow("terminal", "low", 4, 0.5, 0.5, 10.0, 1.0, task_success=(1.0, 0.0, 1.0, 0.0))
    text = format_eval_table([b], [a], [c])
    assert "sft ctl" in text.splitlines()[0]
    q = paired_diff(c.task_success, a.task_success)
    assert f"{q.mean:+.3f}" in text.splitlines()[-1] and f"{q.t:.2f}" in text.splitlines()[-1]


def test_the_title_says_after_sft_only_when_sft_ran(tmp_path, capsys):
    from rl.evaluate import print_eval_table

    b = EvalRow("terminal", "low", 2, 0.5, 0.5, 10.0, 1.0, task_success=(0.0, 1.0))
    a = EvalRow("terminal", "low", 2, 1.0, 1.0, 10.0, 1.0, task_success=(1.0, 1.0))
    for sft, title in ((True, "held-out evaluation: before RL (after SFT) | after RL"),
                       (False, "held-out evaluation: before RL | after RL")):
        print_eval_table(tmp_path, [b], [a], {"terminal": "terminal-v0"}, sft=sft)
        assert (tmp_path / "eval_table.txt").read_text().splitlines()[0] == title
        assert capsys.readouterr().out.splitlines()[0] == title


def test_load_eval_reads_back_what_evaluate_wrote(tmp_path):
    import json
    from dataclasses import asdict

    from rl.evaluate import EvalRow, load_eval

    rows = [EvalRow(domain="cad", tier="low", n=3, success=0.5, reward=0.6, tokens=61.7, turns=1.0, samples=2,
                    task_success=(1.0, 0.5, 0.0))]
    (tmp_path / "eval_before.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))  # as evaluate writes it
    assert load_eval(tmp_path, "before") == rows
    assert load_eval(tmp_path, "after") is None


def test_eval_reads_its_checkpoint_argument_as_train_does(tmp_path):
    from rl.evaluate import eval_model
    from rl.models_cli import light_hub

    run = tmp_path / "run7" / "checkpoint"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    assert eval_model(str(run)) == (str(run / "hf"), "hf")  # a run's checkpoint directory: its hf/ weights
    assert eval_model(str(run / "hf")) == (str(run / "hf"), "hf")
    assert eval_model("tiny") == ("tiny", "tiny")  # shipped: random weights built by the run
    hub = light_hub()
    name = hub.names()[0]  # a pullable name becomes its directory, as model.arch does for `jointrl train`
    want = str(hub.local_path(name)) if hub.is_cached(name) else name
    assert eval_model(name, pull=False) == (want, name)
