"""Multi-node runs on one machine: Ray's own test cluster (`ray.cluster_utils.Cluster`: one raylet and
one object store per node), roles placed by custom node resources, nodes removed mid-run.

Nodes: a head with no CPUs (the driver only), a trainer node (`trainer_node`) and two rollout nodes
(`rollout_node`); `trainer.node_resource` / `rollout.node_resource` keep each role on its nodes.
Tiny fp32 Qwen3-MoE, terminal-basics, 2 tasks x 2 samples, 32 new tokens a turn, 2 RL steps.

- The trainer's node is killed while its step-1 update runs: the step fails with `TrainerLostError`
  naming what to do. `jointrl train` on the same config then says that no node offers
  `trainer_node` and waits; once a new trainer node joins it resumes from the step-1 checkpoint,
  says so, and finishes without repeating or skipping a step.
- The node holding the rollout worker is killed while it generates in step 1: the dispatcher
  re-creates the worker on the other rollout node, the step completes with exactly G episodes per
  task, none errored, every request answered once, and the same episodes as the undisturbed step 1
  of the first test; weight syncs go through the object store across nodes (`sync/shm` 0) and the
  engine's logprobs match the trainer's.

The two cluster tests (slow) share one cluster; the first leaves a fresh trainer node behind. A fast
test checks the config keys' validation, the placement they produce and the start-up check.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests import REPO

G, TASKS = 2, 2
UNDISTURBED: dict[str, list] = {}  # step-1 groups of the first test's run, before its trainer was lost


class Nodes:
    """The test cluster and which of its nodes play which role."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.trainer = self.add("trainer_node")
        self.rollout = [self.add("rollout_node"), self.add("rollout_node")]

    def add(self, resource: str):
        return self.cluster.add_node(num_cpus=1, resources={resource: 1}, object_store_memory=200 * 2**20)

    def remove(self, node) -> None:
        """Kill `node`'s raylet, object store and workers at once, as a crashed machine would go."""
        self.cluster.remove_node(node, allow_graceful=False)

    @staticmethod
    def wait_until_gone(resource: str, timeout_s: float = 120.0) -> None:
        """Until Ray's health checks have declared the nodes offering `resource` dead."""
        import ray

        deadline = time.time() + timeout_s
        while ray.cluster_resources().get(resource, 0.0) > 0 and time.time() < deadline:
            time.sleep(0.5)


@pytest.fixture(scope="module")
def nodes():
    import ray
    from ray.cluster_utils import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="mn-", dir=REPO / ".cache"))  # short: Ray's socket paths live under it
    with pytest.MonkeyPatch.context() as mp:
        # The test cluster records its address in $RAY_TMPDIR/ray/ray_current_cluster (default /tmp/ray),
        # where a plain `ray.init()` of any process on this machine would find and join it: keep it here.
        mp.setenv("RAY_TMPDIR", str(tmp))
        (tmp / "ray").mkdir()
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": str(tmp), "include_dashboard": False})
            n = Nodes(cluster)
            cluster.wait_for_nodes()
            # As inside `ray job submit`: the driver joins this cluster, and a finished run leaves it up.
            mp.setenv("RAY_ADDRESS", cluster.address)
            ray.init(address=cluster.address)
            yield n
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_qwen_moe(tmp_path_factory) -> Path:
    from tests.helpers.checkpoints import build_test_checkpoint

    return build_test_checkpoint(tmp_path_factory.mktemp("qmoe"))


def _overrides(model_dir: Path, run_dir: Path) -> list[str]:
    return [f"model.arch={model_dir}", f"run_dir={run_dir}", "name=multinode",
            "rollout.max_model_len=1024", "rollout.max_new_tokens_per_turn=32", "rollout.kv_cache_gib=0.5",
            "envs.weights={terminal: 1.0}", "envs.env_ids.terminal=terminal-basics-v0", "envs.max_turns=2",
            f"algorithm.group_size={G}", "algorithm.dynamic_sampling=off",
            f"trainer.tasks_per_step={TASKS}", "trainer.micro_batch_size=4", "trainer.lr=1e-3", "trainer.steps=2",
            "trainer.checkpoint_every=1", "eval.n_per_domain=1", "logging.wandb_mode=disabled",
            "trainer.node_resource=trainer_node", "rollout.node_resource=rollout_node"]


def _rl_rows(run_dir: Path) -> list[dict]:
    from rl.observe.sink import read_metrics

    return [r for r in read_metrics(run_dir) if "reward/mean/terminal" in r]


def _check_cross_node_syncs(rows: list[dict]) -> None:
    for r in rows:
        assert r["sync/shm"] == 0.0, r  # trainer and engine on different nodes: the object store carried it
        assert r["mismatch/logprob_abs_mean"] < 2e-3, r["mismatch/logprob_abs_mean"]  # and the engine serves exactly it
        assert r["mismatch/logprob_abs_max"] < 2e-2
        assert r["episodes/count/terminal"] == TASKS * G


def test_node_resource_keys_are_validated_placed_and_checked_at_start(monkeypatch):
    import ray

    from rl.config import ConfigError, load_config
    from rl.placement import check_node_resources, describe_placement
    from rl.trainer.group import TrainerResources

    for bad, why in (("CPU", "is a resource Ray counts on every node"), ("trainer node", "must not contain whitespace")):
        with pytest.raises(ConfigError, match=f"config key 'trainer.node_resource': '{bad}' {why}"):
            load_config(None, [f"trainer.node_resource={bad}"])
    with pytest.raises(ConfigError, match="config key 'rollout.node_resource': 'memory'"):
        load_config(None, ["rollout.node_resource=memory"])
    cfg = load_config(None, ["trainer.node_resource=trainer_node", "rollout.node_resource=node:10.0.0.7"])
    assert TrainerResources(num_cpus=2, node_resource="trainer_node").bundle() == {"CPU": 2, "trainer_node": 0.001}
    assert TrainerResources().bundle() == {"CPU": 1.0}
    trainer, rollout = [line for line in describe_placement(cfg) if line.startswith(("trainer:", "rollout:"))]
    assert "trainer_node: 0.001" in trainer and "node:10.0.0.7=0.001" in rollout

    # At start-up: a resource no node offers is refused on the run's own Ray, only a warning on a cluster.
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "rollout_node": 1.0, "node:10.0.0.7": 1.0})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="no node of the Ray cluster offers resource 'trainer_node' "
                                          r"\(custom resources offered: rollout_node\)"):
        check_node_resources(cfg)
    check_node_resources(cfg, with_trainer=False)  # evaluation starts no trainer
    records = _Records()
    logging.getLogger("jointrl").addHandler(records)
    try:
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
        check_node_resources(cfg)
    finally:
        logging.getLogger("jointrl").removeHandler(records)
    assert len(records.messages) == 1 and "its ranks wait until a node started with" in records.messages[0]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.slow
def test_trainer_node_loss_fails_the_step_and_jointrl_train_resumes(nodes, tiny_qwen_moe, tmp_path):
    from rl.cli import main as jointrl
    from rl.config import load_config
    from rl.setup import start_run
    from rl.run import run
    from rl.trainer.group import TrainerLostError

    run_dir = tmp_path / "run"
    ov = _overrides(tiny_qwen_moe, run_dir)
    cfg = load_config(None, ov)
    parts = start_run(cfg)
    try:
        assert parts.policy.trainer.node_ids() == [nodes.trainer.node_id]
        assert parts.rollouts.engine.reader_nodes()[0] in {n.node_id for n in nodes.rollout}
        orig_rollout, orig_submit = parts.rollouts.rollout, parts.policy.submit

        def rollout(tasks, step, *a, **kw):
            groups, m = orig_rollout(tasks, step, *a, **kw)
            if step == 1:
                UNDISTURBED["groups"] = groups
            return groups, m

        def submit_then_lose_the_trainer_node(*a, **kw):
            pending = orig_submit(*a, **kw)
            if "groups" in UNDISTURBED:  # step 1's update is on its way: its node goes
                nodes.remove(nodes.trainer)
            return pending

        parts.rollouts.rollout, parts.policy.submit = rollout, submit_then_lose_the_trainer_node
        with pytest.raises(TrainerLostError) as lost:
            run(cfg, parts)
    finally:
        parts.close()
    msg = str(lost.value)
    print("the failed step said:", msg)
    assert msg.startswith("trainer rank 0 was lost") and "run `jointrl train` again with the same config" in msg
    assert json.loads((run_dir / "checkpoint" / "meta.json").read_text())["step"] == 1
    assert [r["step"] for r in _rl_rows(run_dir)] == [0]

    # `jointrl train` again on the same config, while no node offers trainer_node: it says so and waits;
    # a new trainer node joins (as an autoscaler or an operator would add one) and the run resumes.
    nodes.wait_until_gone("trainer_node")
    records = _Records()
    logging.getLogger("jointrl").addHandler(records)
    waiting = "no node of the Ray cluster offers resource 'trainer_node'"

    result: dict = {}

    def jointrl_train_again() -> None:  # in a thread: Ray starts nodes only from the main thread (signal handlers)
        t0 = time.perf_counter()
        try:
            result["rc"] = jointrl(["train", "-", *ov])
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e
        result["s"] = time.perf_counter() - t0

    rerun = threading.Thread(target=jointrl_train_again)
    rerun.start()
    try:
        deadline = time.time() + 300
        while not any(waiting in m for m in records.messages) and rerun.is_alive() and time.time() < deadline:
            time.sleep(0.2)
        nodes.trainer = nodes.add("trainer_node")
        rerun.join(timeout=600)
    finally:
        logging.getLogger("jointrl").removeHandler(records)
    print(f"resumed run: {result}")
    assert not rerun.is_alive() and result.get("rc") == 0, result
    assert any(waiting in m and "wait until a node started with" in m for m in records.messages), records.messages
    resumed = [m for m in records.messages if m.startswith("resumed from the last checkpoint")]
    print("resume message:", resumed)
    assert len(resumed) == 1 and "step 1" in resumed[0] and "`jointrl train` was started again" in resumed[0]
    rows = _rl_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]  # step 1 ran once, after the resume; step 0 was not redone
    assert json.loads((run_dir / "checkpoint" / "meta.json").read_text())["step"] == 2
    _check_cross_node_syncs(rows)


@pytest.mark.slow
def test_rollout_node_loss_recreates_the_worker_and_the_step_completes(nodes, tiny_qwen_moe, tmp_path):
    import ray

    from rl.config import load_config
    from rl.setup import start_run
    from rl.run import run

    run_dir = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_qwen_moe, run_dir))
    parts = start_run(cfg)
    removed: dict = {}
    served: list[tuple[list, int]] = []  # step 1: (request seeds, results) of every dispatcher call
    try:
        trainer_nodes = parts.policy.trainer.node_ids()
        first = parts.rollouts.engine.reader_nodes()[0]
        victim = next(n for n in nodes.rollout if n.node_id == first)
        survivor = next(n for n in nodes.rollout if n.node_id != first)
        assert trainer_nodes == [nodes.trainer.node_id] and first != trainer_nodes[0]
        orig_rollout, orig_generate = parts.rollouts.rollout, parts.rollouts.engine.generate

        def remove_while_generating(handle, stop: threading.Event) -> None:
            while not stop.is_set():
                if ray.get(handle.health.remote()).pending_requests > 0:
                    removed["pending"] = True
                    nodes.remove(victim)
                    return
                time.sleep(0.01)

        def generate(reqs):
            out = orig_generate(reqs)
            if "step1" in removed:
                served.append(([r.seed for r in reqs], len(out)))
            return out

        def rollout(tasks, step, *a, **kw):
            if step != 1:
                return orig_rollout(tasks, step, *a, **kw)
            removed["step1"] = True
            stop = threading.Event()
            t = threading.Thread(target=remove_while_generating, args=(parts.rollouts.engine.handles[0], stop))
            t.start()
            try:
                groups, m = orig_rollout(tasks, step, *a, **kw)
            finally:
                stop.set()
                t.join()
            removed["groups"] = groups
            return groups, m

        parts.rollouts.rollout, parts.rollouts.engine.generate = rollout, generate
        run(cfg, parts)
        after = parts.rollouts.engine.reader_nodes()
        restarts = parts.rollouts.engine.restarts
    finally:
        parts.close()
        if "pending" in removed:
            nodes.rollout.remove(victim)
    assert removed.get("pending"), "the rollout node was not removed while its worker was generating"
    assert restarts == [1] and after == [survivor.node_id], (restarts, after)
    groups = removed["groups"]
    assert len(groups) == TASKS and all(len(g.episodes) == G for g in groups)
    assert not [e for g in groups for e in g.episodes if e.metrics.get("episode_error")]
    seeds = [s for reqs, _ in served for s in reqs]
    assert all(n == len(reqs) for reqs, n in served) and len(seeds) == len(set(seeds)), served
    rows = _rl_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    _check_cross_node_syncs(rows)
    if "groups" in UNDISTURBED:  # per-request seeds, fp32: the retried step is the undisturbed one
        want = [[(e.token_ids, e.reward) for e in g.episodes] for g in UNDISTURBED["groups"]]
        assert [[(e.token_ids, e.reward) for e in g.episodes] for g in groups] == want
