"""rl/train.py's step functions on hand-built rollout groups: dynamic sampling and DAPO oversampling.

The whole loop on real engines is tests/rl/test_train_e2e.py. Here `oversample` gets a stand-in for
the rollouts with the method it calls (`rollout`) and a real sampler, so the bound, the draw
numbering (fresh sampling seeds per draw) and the stop condition are checked exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rl.sampler import DomainSampler
from rl.train import dynamic_sampling, oversample
from rl.types import Episode, RolloutGroup


def _group(task: str, rewards: list[float]) -> RolloutGroup:
    eps = tuple(Episode(task_id=task, domain="d", group_id=task, token_ids=(1, 2), loss_mask=(0, 1),
                        rollout_logprobs=(0.0, -1.0), messages=(), reward=r) for r in rewards)
    return RolloutGroup(task_id=task, domain="d", episodes=eps)


@dataclass
class _Rollouts:
    """Tasks named `s*` get rewards with variance (signal); others all-equal rewards."""

    sampler: DomainSampler
    calls: list[tuple[int, int, int]] = field(default_factory=list)  # (n tasks, step, draw)

    def rollout(self, tasks, step, draw=0):
        self.calls.append((len(tasks), step, draw))
        return [_group(t, [0.0, 1.0] if t.startswith("s") else [1.0, 1.0]) for t in tasks], {}


def test_oversample_draws_until_enough_groups_have_signal():
    # pool order: flat, flat, signal, flat, signal, signal, ... (the sampler cycles through it)
    pool = ["f0", "f1", "s0", "f2", "s1", "s2", "s3", "f3"]
    rollouts = _Rollouts(DomainSampler({"d": pool}, {"d": 1.0}, seed=0))
    first = [_group("f9", [1.0, 1.0]), _group("s9", [0.0, 1.0])]  # 1 of 2 with signal
    groups, extra = oversample(rollouts, rollouts.sampler, step=7, groups=first, want=2, max_tasks=8)
    kept, _ = dynamic_sampling(groups, "oversample")
    assert len(kept) == 2 and extra == sum(n for n, _, _ in rollouts.calls)
    assert all(step == 7 for _, step, _ in rollouts.calls)
    assert [d for _, _, d in rollouts.calls] == list(range(1, len(rollouts.calls) + 1))  # each draw its own seeds


def test_oversample_stops_at_the_task_bound():
    rollouts = _Rollouts(DomainSampler({"d": ["f0", "f1", "f2"]}, {"d": 1.0}, seed=0))  # no task ever has signal
    first = [_group("f9", [1.0, 1.0]), _group("f8", [0.0, 0.0])]
    groups, extra = oversample(rollouts, rollouts.sampler, step=0, groups=first, want=2, max_tasks=5)
    assert len(groups) == 5 and extra == 3
    assert dynamic_sampling(groups, "oversample")[0] == []


def test_oversample_draws_nothing_when_the_first_rollout_suffices():
    rollouts = _Rollouts(DomainSampler({"d": ["s0"]}, {"d": 1.0}, seed=0))
    first = [_group("s8", [0.0, 1.0]), _group("s9", [1.0, 0.0])]
    groups, extra = oversample(rollouts, rollouts.sampler, step=0, groups=first, want=2, max_tasks=4)
    assert groups == first and extra == 0 and rollouts.calls == []
