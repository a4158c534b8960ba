"""DomainSampler: weights honoured, no starvation under adaptation, deterministic and resumable."""
from collections import Counter

import pytest

from rl.sampler import DomainSampler, apportion


def test_apportion_sums_and_follows_weights():
    assert apportion({"a": 1, "b": 1}, 4) == {"a": 2, "b": 2}
    assert sum(apportion({"a": 0.7, "b": 0.2, "c": 0.1}, 7).values()) == 7
    assert apportion({"a": 3, "b": 1, "c": 0}, 8) == {"a": 6, "b": 2, "c": 0}


def test_sampler_covers_pool_before_repeating_and_is_deterministic():
    pools = {"x": [f"x{i}" for i in range(5)], "y": [f"y{i}" for i in range(3)]}
    s1 = DomainSampler(pools, {"x": 1.0, "y": 0.0}, seed=3)
    got = s1.sample(5)
    assert sorted(got) == sorted(pools["x"])  # one full epoch, no repeats
    s2 = DomainSampler(pools, {"x": 1.0, "y": 0.0}, seed=3)
    assert s2.sample(5) == got


def test_adaptive_moves_weight_but_keeps_floor():
    pools = {"a": list(range(10)), "b": list(range(10))}
    s = DomainSampler(pools, {"a": 1.0, "b": 1.0}, adaptive=True, min_weight=0.1, ema=0.0)
    s.observe({"a": 1.0, "b": 0.0})
    assert s.weights["a"] > 0.8 and s.weights["b"] == pytest.approx(0.1)
    c = Counter(t for t in s.sample(20))
    assert sum(c.values()) == 20


def test_state_roundtrip_resumes_identically():
    pools = {"a": list(range(7)), "b": list(range(4))}
    s = DomainSampler(pools, {"a": 2.0, "b": 1.0}, seed=1)
    s.sample(5)
    st = s.state_dict()
    nxt = s.sample(9)
    s2 = DomainSampler(pools, {"a": 2.0, "b": 1.0}, seed=99)
    s2.load_state_dict(st)
    assert s2.sample(9) == nxt


def test_missing_pool_is_an_error():
    with pytest.raises(ValueError, match="no tasks"):
        DomainSampler({"a": []}, {"a": 1.0})
