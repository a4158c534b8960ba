"""DomainSampler: weights honoured, no starvation (also at 500 domains), the three adaptive rules against
references written from their formulas, the family level, deterministic and resumable; the learnability
and DUMP rules compared on a simulated mixture of solved, hopeless and learnable domains."""
import math
import random
from collections import Counter

import pytest
import torch

from rl.algos.advantages import grpo_advantages_B
from rl.sampler import DomainSampler, learnability, systematic_apportion, unit_stats
from rl.types import Episode, RolloutGroup


def group(domain: str, rewards, gid: str = "g") -> RolloutGroup:
    eps = tuple(Episode(task_id=gid, domain=domain, group_id=gid, token_ids=(), loss_mask=(), rollout_logprobs=(),
                        messages=(), reward=float(r)) for r in rewards)
    return RolloutGroup(task_id=gid, domain=domain, episodes=eps)


def test_systematic_apportion_is_floor_or_ceil_and_unbiased():
    rng = random.Random(0)
    w = {f"d{i}": rng.random() for i in range(37)}
    w["zero"] = 0.0
    total = sum(w.values())
    sums = Counter()
    trials = 3000
    for _ in range(trials):
        c = systematic_apportion(w, 10, rng.random())
        assert sum(c.values()) == 10 and c["zero"] == 0
        for k, n in c.items():
            exact = 10 * w[k] / total
            assert math.floor(exact) <= n <= math.ceil(exact)
            sums[k] += n
    for k in w:  # E[count] = exact share (systematic sampling is unbiased)
        assert sums[k] / trials == pytest.approx(10 * w[k] / total, abs=0.05)
    with pytest.raises(ValueError):
        systematic_apportion(w, 3, 1.0)


def test_sampler_covers_pool_before_repeating_and_is_deterministic():
    pools = {"x": [f"x{i}" for i in range(5)], "y": [f"y{i}" for i in range(3)]}
    s1 = DomainSampler(pools, {"x": 1.0, "y": 0.0}, seed=3)
    got = s1.sample(5)
    assert sorted(got) == sorted(pools["x"])  # one full epoch, no repeats
    s2 = DomainSampler(pools, {"x": 1.0, "y": 0.0}, seed=3)
    assert s2.sample(5) == got


def test_no_domain_starves_at_500_domains_with_a_small_batch():
    pools = {f"rg-{i:03d}": [f"{i}/{j}" for j in range(4)] for i in range(500)}
    s = DomainSampler(pools, {d: 1.0 for d in pools}, seed=0)
    seen = Counter(t.split("/")[0] for _ in range(40) for t in s.sample(64))
    assert len(seen) == 500  # largest-remainder rounding would give the same 64 names every step
    assert max(seen.values()) - min(seen.values()) <= 8


def test_unit_stats_match_grpo_and_the_learnability_formula():
    groups = [group("a", [1, 0, 0, 1], "g1"), group("a", [1, 1, 1, 1], "g2"), group("b", [0.25, 0.5], "g3")]
    st = unit_stats(groups)
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1.0])
    adv, _ = grpo_advantages_B(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert st["a"].abs_adv == pytest.approx(adv.abs().tolist(), abs=1e-6)
    # from the formula: g1 has mean 1/2 and sample std sqrt(4 * (1/2)^2 / 3); g2 has no signal
    assert st["a"].abs_adv == pytest.approx([0.5 / (math.sqrt(1 / 3) + 1e-6)] * 4 + [0.0] * 4, abs=1e-12)
    assert st["a"].zero_var_frac == 0.5 and st["a"].success == pytest.approx(6 / 8)
    assert learnability(st["a"]) == pytest.approx(0.5 * 4 * 0.75 * 0.25)
    assert st["b"].success == pytest.approx(0.375) and st["b"].zero_var_frac == 0.0


def test_variance_rule_moves_weight_but_keeps_floor():
    pools = {"a": list(range(10)), "b": list(range(10))}
    s = DomainSampler(pools, {"a": 1.0, "b": 1.0}, adaptive=True, min_weight=0.1, ema=0.0)
    s.observe([group("a", [0, 1]), group("b", [1, 1])])
    assert s.weights["a"] > 0.8 and s.weights["b"] == pytest.approx(0.1)
    assert sum(Counter(s.sample(20)).values()) == 20


def test_learnability_prefers_half_solved_domains():
    pools = {d: list(range(10)) for d in ("solved", "hopeless", "half", "mostly")}
    s = DomainSampler(pools, {d: 1.0 for d in pools}, adaptive=True, rule="learnability", min_weight=0.05, ema=0.0)
    s.observe([group("solved", [1, 1, 1, 1]), group("hopeless", [0, 0, 0, 0]),
               group("half", [1, 0, 1, 0]), group("mostly", [1, 1, 1, 0])])
    w = s.weights
    # reference from the formula: raw = (1 - zvf) * 4p(1-p); w = floor + (1 - 4 floor) raw / sum(raw)
    raw = {"solved": 0.0, "hopeless": 0.0, "half": 1.0, "mostly": 4 * 0.75 * 0.25}
    for d in pools:
        assert w[d] == pytest.approx(0.05 + 0.8 * raw[d] / sum(raw.values()))
    assert sum(w.values()) == pytest.approx(1.0)


def test_dump_rule_matches_ucb_reference():
    pools = {d: list(range(10)) for d in ("a", "b", "c")}
    s = DomainSampler(pools, {d: 1.0 for d in pools}, adaptive=True, rule="dump", min_weight=0.02, dump_c=0.5,
                      dump_temperature=0.2, dump_window=6)
    s.observe([group("a", [1, 0, 1, 0])])
    assert s.weights["b"] == s.weights["c"] > s.weights["a"]  # units never observed come first (UCB = inf)
    batches = [[group("a", [1, 0, 0, 0]), group("b", [1, 1, 1, 0]), group("c", [0, 0, 0, 0])],
               [group("a", [1, 1, 0, 0]), group("b", [0.5, 0, 1, 1])]]
    hist = {"a": [1, 0, 1, 0], "b": [], "c": []}
    adv = {"a": [abs(x) for x in grpo_advantages_B(torch.tensor([1, 0, 1, 0.0]), torch.zeros(4, dtype=torch.long))[0].tolist()],
           "b": [], "c": []}
    for batch in batches:
        s.observe(batch)
        for g in batch:
            a, _ = grpo_advantages_B(torch.tensor(g.rewards), torch.zeros(len(g.rewards), dtype=torch.long))
            adv[g.domain] += [abs(x) for x in a.tolist()]
        N = sum(len(v) for v in adv.values())
        ucb = {d: sum(v[-6:]) / len(v[-6:]) + 0.5 * math.sqrt(2 * math.log(N) / len(v)) for d, v in adv.items()}
        top = max(ucb.values())
        soft = {d: math.exp((u - top) / 0.2) for d, u in ucb.items()}
        for d in pools:
            assert s.weights[d] == pytest.approx(0.02 + (1 - 0.06) * soft[d] / sum(soft.values()), rel=1e-6)


def test_family_level_adapts_families_and_splits_by_base_weight():
    pools = {d: list(range(4)) for d in ("x1", "x2", "y1")}
    fam = {"x1": "x", "x2": "x", "y1": "y"}
    s = DomainSampler(pools, {"x1": 3.0, "x2": 1.0, "y1": 1.0}, adaptive=True, rule="variance", level="family",
                      families=fam, min_weight=0.1, ema=0.0)
    s.observe([group("x1", [1, 1]), group("x2", [1, 1]), group("y1", [0, 1])])  # family x: no signal
    assert s.weights["x1"] + s.weights["x2"] == pytest.approx(0.1)
    assert s.weights["x1"] == pytest.approx(3 * s.weights["x2"])
    assert s.weights["y1"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="family"):
        DomainSampler(pools, {"x1": 1.0}, level="family")
    with pytest.raises(ValueError, match="rule"):
        DomainSampler(pools, {"x1": 1.0}, rule="ucb")


def test_not_adaptive_ignores_observations():
    pools = {"a": [1], "b": [2]}
    s = DomainSampler(pools, {"a": 1.0, "b": 1.0}, rule="dump")
    s.observe([group("a", [0, 1])])
    assert s.weights == {"a": 1.0, "b": 1.0}


def test_state_roundtrip_resumes_sequence():
    pools = {"a": list(range(7)), "b": list(range(3))}
    s = DomainSampler(pools, {"a": 2.0, "b": 1.0}, seed=1, adaptive=True, rule="dump")
    s.sample(4)
    s.observe([group("a", [0, 1]), group("b", [1, 0.5])])
    st = s.state_dict()
    s2 = DomainSampler(pools, {"a": 2.0, "b": 1.0}, seed=99, adaptive=True, rule="dump")
    s2.load_state_dict(st)
    assert s.sample(6) == s2.sample(6)
    s.observe([group("b", [0, 1])])
    s2.observe([group("b", [0, 1])])
    assert s.weights == s2.weights


def test_reconfigured_keeps_state_and_changes_rule():
    pools = {"a": list(range(7)), "b": list(range(3))}
    s = DomainSampler(pools, {"a": 1.0, "b": 1.0}, seed=1, adaptive=True)
    s.sample(3)
    restored = s.state_dict()
    base = DomainSampler(pools, {"a": 1.0, "b": 1.0}, seed=5, adaptive=True)
    base.load_state_dict(restored)  # what the runtime does on resume
    r = base.reconfigured(rule="learnability")
    assert r.rule == "learnability" and r.sample(5) == s.sample(5)


def test_empty_pool_with_weight_raises():
    with pytest.raises(ValueError):
        DomainSampler({"a": []}, {"a": 1.0})


def simulate(rule: str, steps: int = 30, seed: int = 0) -> dict[str, float]:
    """A mixture of 30 domains: 10 solved (p = 0.98), 10 hopeless (p = 0.02), 10 learnable (p = 0.5);
    8 tasks x 4 samples per step. Returns the share of sampled tasks per kind."""
    rng = random.Random(seed)
    p = {f"{kind}{i}": q for kind, q in (("solved", 0.98), ("hopeless", 0.02), ("learn", 0.5)) for i in range(10)}
    s = DomainSampler({d: [d] * 4 for d in p}, {d: 1.0 for d in p}, seed=seed, adaptive=rule != "static",
                      rule="variance" if rule == "static" else rule, min_weight=0.005, ema=0.5)
    got = Counter()
    for _ in range(steps):
        ts = s.sample(8)
        got.update(t.rstrip("0123456789") for t in ts)
        s.observe([group(d, [float(rng.random() < p[d]) for _ in range(4)], f"{d}{i}") for i, d in enumerate(ts)])
    n = sum(got.values())
    return {k: v / n for k, v in got.items()}


def test_learnability_and_dump_both_shift_samples_to_learnable_domains():
    share = {rule: simulate(rule) for rule in ("static", "learnability", "dump")}
    assert share["static"]["learn"] == pytest.approx(1 / 3, abs=0.1)
    assert share["learnability"]["learn"] > 0.5
    assert share["dump"]["learn"] > share["static"]["learn"] + 0.1


def test_config_keys_select_the_rule_and_reject_bad_values():
    from rl.config import ConfigError, load_config

    cfg = load_config(None, ["envs.adaptive_weights=true", "envs.sampler_rule=dump", "envs.sampler_level=family",
                             "envs.dump_c=0.0", "envs.dump_temperature=0.5"])
    e = cfg.envs
    pools = {d: [d] for d in ("a1", "a2", "b1")}
    fam = {"a1": "a", "a2": "a", "b1": "b"}
    s = DomainSampler(pools, {d: 1.0 for d in pools}, adaptive=e.adaptive_weights, min_weight=e.min_weight)
    # what rl/train.py does with the run record's families
    s = s.reconfigured(rule=e.sampler_rule, level=e.sampler_level, families=fam, dump_c=e.dump_c,
                       dump_temperature=e.dump_temperature)
    s.observe([group("a1", [1, 0]), group("b1", [1, 1])])
    # dump_c = 0: pure mean |advantage| per family: family a has 0.707, b 0
    soft = {"a": 1.0, "b": math.exp((0.0 - 0.5 / (0.5 ** 0.5)) / 0.5)}  # exp((ucb - max) / temperature)
    want_a = e.min_weight + (1 - 2 * e.min_weight) * soft["a"] / (soft["a"] + soft["b"])
    assert s.weights["a1"] + s.weights["a2"] == pytest.approx(want_a, abs=1e-3)
    assert s.weights["a1"] == pytest.approx(s.weights["a2"])
    for bad, key in (("envs.sampler_rule=ucb", "envs.sampler_rule"), ("envs.sampler_level=task", "envs.sampler_level"),
                     ("envs.dump_temperature=0", "envs.dump_temperature"), ("envs.dump_c=-1", "envs.dump_c")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])
