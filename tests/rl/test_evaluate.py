"""The paired comparison behind the held-out before/after table, against the formula and scipy's own paired test."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rl.evaluate import EvalRow, format_eval_table, paired_diff


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
