"""Largest-remainder apportioning (rl/algos/apportion.py) against the rule written out by hand."""
from __future__ import annotations

import math
import random

import pytest

from rl.algos.apportion import largest_remainder


def _reference(total, weights, rank=None):
    # Hamilton's method, spelled out: floors of the quotas, then +1 down the list of remainders.
    pos = [k for k in weights if weights[k] > 0]
    if total <= 0 or not pos:
        return {k: 0 for k in weights}
    s = sum(weights[k] for k in pos)
    quotas = {k: total * weights[k] / s for k in pos}
    counts = {k: (math.floor(quotas[k]) if k in quotas else 0) for k in weights}
    by_remainder = sorted(pos, key=lambda k: (-(quotas[k] - math.floor(quotas[k])), (rank or {}).get(k, 0), k))
    for k in by_remainder[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def test_small_cases():
    assert largest_remainder(4, {"a": 1, "b": 1}) == {"a": 2, "b": 2}
    assert largest_remainder(8, {"a": 3, "b": 1, "c": 0}) == {"a": 6, "b": 2, "c": 0}
    assert largest_remainder(1, {"b": 1, "a": 1}) == {"b": 0, "a": 1}  # tie: the smaller name
    assert largest_remainder(1, {"b": 1, "a": 1}, rank={"b": 0, "a": 1}) == {"b": 1, "a": 0}  # tie: the lower rank
    assert list(largest_remainder(3, {"z": 1, "a": 2})) == ["z", "a"]
    assert largest_remainder(0, {"a": 1}) == {"a": 0} and largest_remainder(5, {"a": 0}) == {"a": 0}


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_rule_and_its_properties(seed):
    rng = random.Random(seed)
    for _ in range(200):
        keys = [f"d{i}" for i in rng.sample(range(20), rng.randint(1, 8))]
        weights = {k: rng.choice([0.0, 0.5, 1.0, rng.random() * 3]) for k in keys}
        rank = {k: i for i, k in enumerate(rng.sample(keys, len(keys)))}
        total = rng.randint(0, 40)
        got = largest_remainder(total, weights, rank)
        assert got == _reference(total, weights, rank)
        s = sum(w for w in weights.values() if w > 0)
        if s > 0 and total > 0:
            assert sum(got.values()) == total
            assert all(math.floor(total * w / s) <= got[k] <= math.ceil(total * w / s) for k, w in weights.items() if w > 0)
