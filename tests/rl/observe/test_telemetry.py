"""rl/observe/telemetry.py (per-domain rollout / gap / ratio metrics) against slow
references written from the definitions."""
from __future__ import annotations

import math

import pytest
import torch

from jointrl.records import Message
from rl.observe.telemetry import logprob_gap_metrics, ratio_metrics, rollout_metrics, time_breakdown
from rl.types import Episode, RolloutGroup


def ep(domain, reward, gen, think=0, turns=1, truncated=False, version=0, metrics=None, wall=1.0):
    """An episode with `gen` generated tokens of which `think` sit inside <think>(4) ... </think>(5)."""
    ids = [20, 21, 22]
    mask = [0, 0, 0]
    if think:
        ids += [4] + [30] * think + [5]
        mask += [1] * (think + 2)
    rest = gen - (think + 2 if think else 0)
    assert rest >= 0
    ids += [40] * rest
    mask += [1] * rest
    return Episode(task_id="t", domain=domain, group_id="g", token_ids=tuple(ids), loss_mask=tuple(mask),
                   rollout_logprobs=tuple(0.0 for _ in ids), messages=(Message(role="user", content="x"),), reward=reward,
                   metrics=metrics or {}, truncated=truncated, num_turns=turns, policy_version=version, wall_s=wall)


def type7_quantile(xs, q):
    """Hyndman & Fan type 7 (linear interpolation between order statistics), by hand."""
    s = sorted(xs)
    h = (len(s) - 1) * q
    lo = math.floor(h)
    return s[lo] + (h - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo])


def test_rollout_metrics_per_domain_match_hand_reference():
    a = [ep("a", 1.0, 10, think=3, turns=2, version=4, metrics={"tool_calls": 2, "tool_errors": 1, "tool_timeouts": 0, "malformed_calls": 0}),
         ep("a", 0.0, 6, turns=1, truncated=True, version=3, metrics={"tool_calls": 3, "tool_errors": 0, "tool_timeouts": 1, "malformed_calls": 1}),
         ep("a", 0.5, 20, think=8, turns=4, version=5, metrics={"tool_calls": 5, "tool_errors": 0, "tool_timeouts": 0, "malformed_calls": 0,
                                                                "sandbox_kills": 1})]
    b = [ep("b", 1.0, 4, turns=1, wall=3.0), ep("b", 1.0, 8, turns=3, wall=5.0)]
    groups = [RolloutGroup("t1", "a", tuple(a[:2])), RolloutGroup("t2", "a", (a[2],)), RolloutGroup("t3", "b", tuple(b))]
    m = rollout_metrics(groups, (4, 5), policy_version=5)
    ra = [1.0, 0.0, 0.5]
    mean = sum(ra) / 3
    assert m["reward/mean/a"] == pytest.approx(mean)
    assert m["reward/std/a"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in ra) / 3))
    assert m["success/rate/a"] == pytest.approx(1 / 3) and m["success/rate/b"] == 1.0
    assert m["tokens/response_mean/a"] == pytest.approx((10 + 6 + 20) / 3)
    assert m["tokens/thinking_mean/a"] == pytest.approx((3 + 0 + 8) / 3)
    for q, name in ((0.0, "min"), (0.1, "p10"), (0.25, "p25"), (0.5, "p50"), (0.75, "p75"), (0.9, "p90"), (1.0, "max")):
        assert m[f"tokens/response_{name}/a"] == pytest.approx(type7_quantile([10, 6, 20], q))
        assert m[f"turns/n_{name}/a"] == pytest.approx(type7_quantile([2, 1, 4], q))
        assert m[f"tokens/thinking_{name}/a"] == pytest.approx(type7_quantile([3, 0, 8], q))
    assert m["episode/truncated_rate/a"] == pytest.approx(1 / 3)
    assert m["tools/error_rate/a"] == pytest.approx((1 + 1 + 1) / 10)  # errors + timeouts + malformed over calls
    assert m["tools/exception_rate/a"] == pytest.approx(1 / 10)
    assert m["tools/timeout_rate/a"] == pytest.approx(1 / 10)
    assert m["tools/calls_mean/a"] == pytest.approx(10 / 3)
    assert m["episode/sandbox_kills_mean/a"] == 1.0  # averaged over the episodes that report it
    assert "tools/error_rate/b" not in m  # b's environment reported no tool counters: no made-up zero
    assert m["policy/staleness_mean/a"] == pytest.approx((1 + 2 + 0) / 3) and m["policy/staleness_max/a"] == 2
    assert m["episode/wall_s_mean/b"] == 4.0 and m["episode/wall_s_max/b"] == 5.0
    assert m["reward/mean/all"] == pytest.approx(sum(ra + [1.0, 1.0]) / 5)
    assert m["success/rate/all"] == pytest.approx(3 / 5)


def test_thinking_tokens_are_zero_for_a_format_without_a_thinking_block():
    # ids 4 and 5 are ordinary tokens of another vocabulary: without think ids nothing is counted as thinking
    g = [RolloutGroup("t", "a", (ep("a", 1.0, 9, think=3),))]
    assert rollout_metrics(g, (4, 5))["tokens/thinking_mean/a"] == 3.0
    m = rollout_metrics(g, None)
    assert m["tokens/thinking_mean/a"] == 0.0 and m["tokens/response_mean/a"] == 9.0
    assert not any(k.startswith("policy/staleness") for k in m)
    assert rollout_metrics([], None)["reward/mean/all"] == 0.0


def _rand(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # a row with no generated tokens
    roll = -torch.rand(B, T, generator=g) * 3
    train = roll + 0.3 * torch.randn(B, T, generator=g)
    dom = torch.tensor([0, 1, 0, 1, 0, 0])
    return train, roll, mask, dom


def test_logprob_gap_matches_loops():
    train, roll, mask, dom = _rand(0)
    m = logprob_gap_metrics(train, roll, mask, dom, ("x", "y", "unused"))
    for name, ids in (("x", {0}), ("y", {1}), ("all", {0, 1})):
        d = [float(train[b, t] - roll[b, t]) for b in range(6) for t in range(9) if mask[b, t] and int(dom[b]) in ids]
        assert m[f"mismatch/logprob_abs_mean/{name}"] == pytest.approx(sum(abs(v) for v in d) / len(d), rel=1e-9)
        assert m[f"mismatch/logprob_abs_max/{name}"] == pytest.approx(max(abs(v) for v in d), rel=1e-9)
        k3 = [math.exp(v) - 1 - v for v in d]  # r - 1 - log r with r = p_train / p_engine
        assert m[f"mismatch/kl_k3/{name}"] == pytest.approx(sum(k3) / len(k3), rel=1e-9)
    assert not any(k.endswith("/unused") for k in m)


def test_ratio_metrics_match_loops():
    new, old, mask, dom = _rand(1)
    m = ratio_metrics(new, old, mask, dom, ("x", "y"), clip_low=0.1, clip_high=0.2)
    for name, ids in (("x", {0}), ("y", {1}), ("all", {0, 1})):
        pts = [(b, t) for b in range(6) for t in range(9) if mask[b, t] and int(dom[b]) in ids]
        r = [math.exp(float(new[b, t] - old[b, t])) for b, t in pts]
        assert m[f"pg/token_clipfrac_low/{name}"] == pytest.approx(sum(x < 0.9 for x in r) / len(r))
        assert m[f"pg/token_clipfrac_high/{name}"] == pytest.approx(sum(x > 1.2 for x in r) / len(r))
        assert m[f"pg/ratio_mean/{name}"] == pytest.approx(sum(r) / len(r), rel=1e-9)
        assert m[f"pg/neg_logprob_mean/{name}"] == pytest.approx(-sum(float(new[b, t]) for b, t in pts) / len(pts), rel=1e-9)


@pytest.mark.parametrize("call,msg", [
    (lambda t, r, m, d: logprob_gap_metrics(t[:, :3], r, m, d, ("x", "y")), "trainer_logprobs_BT must be a tensor of shape"),
    (lambda t, r, m, d: logprob_gap_metrics(t, r, m, d[:2], ("x", "y")), r"domain_ids_B must be \[B=6\]"),
    (lambda t, r, m, d: logprob_gap_metrics(t, r, m, d, ("x",)), "out of range"),
    (lambda t, r, m, d: ratio_metrics(t, r, m, d, ("x", "y"), clip_low=-1), "clip_low"),
])
def test_bad_inputs_are_named(call, msg):
    with pytest.raises(ValueError, match=msg):
        call(*_rand(2))


def test_time_breakdown_splits_rollout_by_episode_seconds_and_reports_idle():
    g = RolloutGroup(task_id="t", domain="a", episodes=(
        ep("a", 1.0, 3, metrics={"time_generate_s": 3.0, "time_tools_s": 1.0, "time_grade_s": 0.0}),
        ep("a", 0.0, 3, metrics={"time_generate_s": 1.0, "time_tools_s": 1.0, "time_grade_s": 2.0})))
    # episode-seconds: generate 4, tools 2, grade 2 -> shares 1/2, 1/4, 1/4 of the 8 s rollout wall time
    m = time_breakdown([g], step_s=12.0, rollout_s=8.0, train_busy_s=3.0, sync_s=0.5)
    assert m["time/rollout_generate_s"] == pytest.approx(4.0)
    assert m["time/rollout_tools_s"] == pytest.approx(2.0)
    assert m["time/rollout_grade_s"] == pytest.approx(2.0)
    assert m["time/trainer_idle_s"] == pytest.approx(12.0 - 3.0 - 0.5)
    assert m["time/rollout_idle_s"] == pytest.approx(12.0 - 8.0 - 0.5)
    # async overlap: training as long as the step itself leaves the trainer no idle time (never negative)
    m = time_breakdown([g], step_s=8.0, rollout_s=8.0, train_busy_s=9.0, sync_s=0.5)
    assert m["time/trainer_idle_s"] == 0.0 and m["time/rollout_idle_s"] == 0.0
    # episodes without timings (e.g. built by hand) give zero shares, not a division error
    m = time_breakdown([RolloutGroup(task_id="t", domain="a", episodes=(ep("a", 0.0, 3),))], step_s=1.0, rollout_s=1.0,
                       train_busy_s=0.0, sync_s=0.0)
    assert m["time/rollout_generate_s"] == 0.0
