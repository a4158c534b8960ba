"""Rubric: weighted sums against a written-out reference, fixed outcomes, visible errors."""
from __future__ import annotations

import math
import random

import pytest

from jointrl.records import Limits, Message, Task
from rewards import EpisodeSummary, Rubric, RubricError, Term, check, format_validity, malformed_fraction, response_chars, turn_fraction

TASK = Task(id="t", domain="d", prompt=(Message(role="user", content="hi"),), limits=Limits(max_turns=8))


def summary(**kw) -> EpisodeSummary:
    base = dict(task=TASK, messages=(Message(role="assistant", content="abcd", reasoning="xy"),), checks={"correct": 1.0},
                num_turns=2, tool_calls=4, malformed_calls=1, terminated=True, truncated=False)
    base.update(kw)
    return EpisodeSummary(**base)


def test_weighted_sum_matches_reference_on_random_rubrics():
    rng = random.Random(0)
    for _ in range(200):
        values = [rng.uniform(-2, 2) for _ in range(rng.randint(1, 5))]
        weights = [rng.uniform(-1, 3) for _ in values]
        terms = tuple(Term(f"t{i}", (lambda v: lambda ep: v)(v), w) for i, (v, w) in enumerate(zip(values, weights)))
        g = Rubric(terms).score(summary())
        expected = 0.0
        for v, w in zip(values, weights):  # the formula, written out
            expected += w * v
        assert math.isclose(g.reward, expected, rel_tol=1e-12, abs_tol=1e-12)
        assert g.error is None and g.metrics["grade_error"] == 0.0
        for i, v in enumerate(values):
            assert g.metrics[f"term/t{i}"] == v


def test_truncated_episode_gets_the_fixed_reward_but_terms_are_logged():
    r = Rubric((Term("correct", check("correct"), 1.0),), truncated_reward=-0.5)
    g = r.score(summary(truncated=True, terminated=False))
    assert g.reward == -0.5 and g.metrics["truncated"] == 1.0 and g.metrics["term/correct"] == 1.0 and g.error is None


@pytest.mark.parametrize("fn, msg", [
    (lambda ep: 1 / 0, "ZeroDivisionError"),
    (lambda ep: float("nan"), "non-finite"),
    (check("missing"), "did not report check 'missing'"),
])
def test_term_failures_are_visible_errors_not_silent_zeros(fn, msg):
    r = Rubric((Term("bad", fn, 1.0),), error_reward=-1.0)
    g = r.score(summary())
    assert g.reward == -1.0 and g.metrics["grade_error"] == 1.0
    assert msg in g.error and "'bad'" in g.error


def test_malformed_rubrics_are_refused():
    with pytest.raises(RubricError, match="duplicate"):
        Rubric((Term("a", format_validity), Term("a", format_validity)))
    with pytest.raises(RubricError, match="not finite"):
        Rubric((Term("a", format_validity, float("inf")),))
    with pytest.raises(RubricError, match="truncated_reward"):
        Rubric((), truncated_reward=float("nan"))


def test_shared_terms():
    ep = summary()
    assert malformed_fraction(ep) == 1 / 4
    assert format_validity(ep) == 3 / 4
    assert malformed_fraction(summary(tool_calls=0, malformed_calls=0)) == 0.0
    assert turn_fraction(ep) == 2 / 8
    assert response_chars(10)(ep) == (4 + 2) / 10
    with pytest.raises(ValueError):
        response_chars(0)
