"""rl/train.py's loop (`rl_steps`) with small fakes for its collaborators: no Ray, no engine, no trainer.

The fakes stand in for what cannot run in a unit test (vLLM engines, DeepSpeed ranks); the loop, the real
`DomainSampler`, the real batch collation and the real advantage estimators run. Checked here in seconds:
dynamic sampling (filter and DAPO oversampling), bounded staleness in async mode, checkpoint cadence (each
save after every update in flight has finished and been synced), and a resume from a checkpoint replaying
the steps an uninterrupted run would. The loop on real engines is tests/rl/test_train_e2e.py.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import pytest

from rl.checkpoint import DriverState
from rl.config import AlgorithmSection
from rl.sampler import DomainSampler
from rl.train import Loop, LoopConfig, rl_steps
from rl.types import Episode, GapStats, RolloutGroup, RolloutStats, SyncStats, TrainResult

G = 2  # samples per task


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


@dataclass
class FakeRollouts:
    """Tasks named `s*` get rewards [0, 1] (signal), others [1, 1]; each episode carries the served version."""

    policy_version: int = 0
    calls: list = field(default_factory=list)  # (tasks, step, draw)
    tok: _Tok = field(default_factory=_Tok)

    def rollout(self, tasks, step, draw=0):
        self.calls.append((list(tasks), step, draw))
        groups = []
        for t in tasks:
            rewards = [0.0, 1.0] if t.startswith("s") else [1.0, 1.0]
            eps = tuple(Episode(task_id=t, domain=t[0], group_id=f"{t}:{step}:{draw}", token_ids=(5, 6, 7), loss_mask=(0, 1, 1),
                                rollout_logprobs=(0.0, -1.0, -1.0), messages=(), reward=r, policy_version=self.policy_version)
                        for r in rewards[:G])
            groups.append(RolloutGroup(task_id=t, domain=t[0], episodes=eps))
        return groups, RolloutStats(per_domain={"reward/mean/s": 0.5}, episodes_per_s=10.0)


@dataclass
class FakePending:
    policy: "FakePolicy"
    staleness: int
    seqs: int

    def finish(self) -> TrainResult:
        self.policy.in_flight -= 1
        self.policy.version += 1
        return TrainResult(seqs=float(self.seqs), busy_s=0.25, world_size=1, staleness=self.staleness)


@dataclass
class FakePolicy:
    """The trainer's version advances when an update finishes; staleness as the real client computes it."""

    version: int = 0
    in_flight: int = 0
    submitted: list = field(default_factory=list)  # task ids of each submitted batch
    next_version: int | None = None

    def penalise_kl(self, groups):
        return groups, {}

    def collate(self, groups):
        from rl.trainer.batch import collate

        eps = [e for g in groups for e in g.episodes]
        return collate(eps, [0.0] * len(eps), domains=sorted({e.domain for e in eps}))

    def values(self, batch):
        return None

    def submit(self, batch, groups):
        if self.next_version is None:
            self.next_version = self.version
        staleness = self.next_version - min(e.policy_version for g in groups for e in g.episodes)
        self.next_version += 1
        self.in_flight += 1
        self.submitted.append([g.task_id for g in groups])
        return FakePending(self, staleness, sum(len(g.episodes) for g in groups))


@dataclass
class FakeSync:
    policy: FakePolicy
    rollouts: FakeRollouts
    pushes: int = 0

    def push(self) -> SyncStats:
        self.pushes += 1
        self.rollouts.policy_version = self.policy.version
        return SyncStats(seconds=0.125, bytes=1000.0, buckets=1.0)

    def gap(self, groups) -> GapStats:
        return GapStats(abs_mean=0.001, abs_max=0.01)


@dataclass
class FakeCheckpoints:
    policy: FakePolicy
    saved: list = field(default_factory=list)  # (state, sampler state, updates in flight at the save)

    def save(self, state, sampler):
        self.saved.append((state, copy.deepcopy(sampler.state_dict()), self.policy.in_flight))


@dataclass
class FakeSink:
    rows: list = field(default_factory=list)

    def log(self, m):
        self.rows.append(m)


def _loop(pool, **algo):
    rollouts, policy = FakeRollouts(), FakePolicy()
    sampler = DomainSampler({"s": pool}, {"s": 1.0}, seed=0)
    loop = Loop(rollouts=rollouts, sampler=sampler, policy=policy, sync=FakeSync(policy, rollouts),
                checkpoints=FakeCheckpoints(policy), sink=FakeSink(), domains=("s",))
    return loop, AlgorithmSection(group_size=G, **algo)


def _cfg(a, steps=4, tasks=4, lag=0, every=0, gap_every=0):
    return LoopConfig(steps=steps, tasks_per_step=tasks, lag=lag, algorithm=a, checkpoint_every=every, gap_every=gap_every)


def _step_rows(loop):
    return [r for r in loop.sink.rows if "policy/version" in r.values]


def test_dynamic_sampling_filters_flat_groups_and_oversampling_tops_them_up():
    pool = ["sa", "fb", "sc", "fd", "se", "ff", "sg", "fh"]  # half with signal
    loop, a = _loop(pool, dynamic_sampling="filter")
    rl_steps(loop, _cfg(a, steps=2), DriverState())
    assert all(all(t.startswith("s") for t in batch) for batch in loop.policy.submitted)  # flat groups never trained
    rows = _step_rows(loop)
    assert [r.values["rollout/groups_kept"] for r in rows] == [len(b) for b in loop.policy.submitted]
    assert all(0.0 <= r.values["rollout/zero_var_frac/s"] <= 1.0 for r in rows)

    loop, a = _loop(pool, dynamic_sampling="oversample", oversample_factor=3.0)
    rl_steps(loop, _cfg(a, steps=2), DriverState())
    assert all(len(b) == 4 for b in loop.policy.submitted)  # topped up to tasks_per_step groups with signal
    draws = [(step, draw) for _, step, draw in loop.rollouts.calls]
    assert draws[0] == (0, 0) and all(d > 0 for s, d in draws[1:] if s == 0)  # extra draws numbered per step
    assert all(r.values["rollout/oversampled_tasks"] > 0 for r in _step_rows(loop))


def test_sync_mode_trains_on_fresh_episodes_and_logs_typed_values():
    loop, a = _loop(["sa", "sb"], dynamic_sampling="off")
    state = rl_steps(loop, _cfg(a, steps=3, gap_every=2), DriverState())
    rows = _step_rows(loop)
    assert [r.step for r in rows] == [0, 1, 2] and state.step == 3 and loop.sync.pushes == 3
    for r in rows:
        v = r.values
        assert v["policy/staleness"] == 0 and v["rollout/max_staleness_seen"] == 0
        assert v["time/train_s"] == 0.25 and v["time/sync_s"] == 0.125 and v["sync/bytes"] == 1000.0  # fields, by their names
        assert v["train/busy_s"] == 0.25 and v["rollout/episodes_per_s"] == 10.0 and v["sampler/weight/s"] == 1.0
        assert ("mismatch/logprob_abs_mean" in v) == (r.step % 2 == 0)
    assert [r.values["policy/version"] for r in rows] == [1, 2, 3]


@pytest.mark.parametrize("lag", [1, 2])
def test_async_mode_keeps_staleness_bounded(lag):
    loop, a = _loop(["sa", "sb", "sc"], dynamic_sampling="off")
    rl_steps(loop, _cfg(a, steps=6, lag=lag), DriverState())
    seen = [r.values["policy/staleness"] for r in loop.sink.rows if "policy/staleness" in r.values]
    assert len(seen) == 6  # every update finished and logged (the last ones when the loop drains)
    assert max(seen) == lag and min(seen) == 0  # bounded by the lag, and the lag is used
    assert loop.policy.in_flight == 0 and loop.rollouts.policy_version == 6


def test_checkpoints_follow_the_cadence_after_draining():
    loop, a = _loop(["sa", "sb", "sc"], dynamic_sampling="off")
    rl_steps(loop, _cfg(a, steps=5, lag=2, every=2), DriverState(rl_seconds=7.0))
    saved = loop.checkpoints.saved
    assert [s.step for s, _, _ in saved] == [2, 4, 5]
    assert all(n == 0 for _, _, n in saved)  # a checkpoint never holds an update in flight
    assert [s.policy_version for s, _, _ in saved] == [2, 4, 5]  # every update synced before it is saved
    assert all(s.rl_seconds >= 7.0 for s, _, _ in saved)  # a resumed run's earlier RL time is kept


def test_a_resumed_run_replays_what_the_uninterrupted_run_did():
    pool = ["sa", "fb", "sc", "fd", "se", "ff", "sg"]
    whole, a = _loop(pool, dynamic_sampling="filter")
    rl_steps(whole, _cfg(a, steps=6, tasks=3, every=2), DriverState())
    state4, sampler4, _ = whole.checkpoints.saved[1]
    assert state4.step == 4

    resumed, _ = _loop(pool, dynamic_sampling="filter")
    resumed.sampler.load_state_dict(sampler4)  # what Checkpoints.resume restores
    resumed.rollouts.policy_version = resumed.policy.version = state4.policy_version
    end = rl_steps(resumed, _cfg(a, steps=6, tasks=3, every=2), state4)
    assert [r.step for r in _step_rows(resumed)] == [4, 5]  # steps before the checkpoint are not redone
    tasks = lambda lp: [(t, s) for t, s, _ in lp.rollouts.calls if s >= 4]  # noqa: E731
    assert tasks(resumed) == tasks(whole)  # the same tasks at the same steps
    assert end.step == 6 and end.policy_version == whole.checkpoints.saved[-1][0].policy_version
    assert Counter(t for b in resumed.policy.submitted for t in b) == Counter(t for b in whole.policy.submitted[-2:] for t in b)


def test_trainer_fields_declare_their_rank_reduction():
    """Every TrainResult / SftStepResult statistic says how ranks combine it (rl/trainer/group.py reads it)."""
    import dataclasses

    from rl.types import Reduce, SftStepResult, metric_names

    for record in (TrainResult, SftStepResult):
        for f in dataclasses.fields(record):
            if f.metadata.get("metric") and f.name != "world_size":
                assert isinstance(f.metadata.get("reduce"), Reduce), f"{record.__name__}.{f.name}"
    assert {"train/seqs", "train/tokens"} <= metric_names(TrainResult, Reduce.SUM)
    assert "train/busy_s" in metric_names(TrainResult, Reduce.MAX) and "sft/nll" in metric_names(SftStepResult, Reduce.SEQ_MEAN)
