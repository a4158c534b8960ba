"""End to end: real Ray actors, a real vLLM engine, a real DeepSpeed engine, two domains.

Three RL steps on a tiny Qwen3-MoE (fp32, so the engine and the trainer compute the same function
and the logprob gap after each sync must be ~0); a rollout worker is killed between steps and the
run goes on; then the run resumes from its checkpoint and continues. One module-scoped run keeps
the engines' start-up cost paid once.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_qwen_moe(tmp_path_factory) -> Path:
    from tests.helpers.checkpoints import build_test_checkpoint

    return build_test_checkpoint(tmp_path_factory.mktemp("qmoe"))


def _cfg(model_dir: Path, run_dir: Path, steps: int):
    from rl.config import load_config

    return load_config(None, [
        f"model.arch={model_dir}", f"run_dir={run_dir}", "name=e2e",
        "rollout.max_model_len=1536", "rollout.max_new_tokens_per_turn=48", "rollout.kv_cache_gib=1.0",
        "envs.weights={terminal: 1.0, browse: 1.0}", "envs.env_ids.browse=browse-small-v0", "envs.max_turns=2",
        "algorithm.group_size=2", "algorithm.dynamic_sampling=off",
        "trainer.sft_steps=2", "trainer.tasks_per_step=2", "trainer.micro_batch_size=4", "trainer.lr=1e-3",
        f"trainer.steps={steps}", "trainer.checkpoint_every=1", "logging.wandb_mode=disabled",
        "logging.gap_every=2",  # the post-sync engine-vs-trainer check at steps 0 and 2, not 1
    ])


def _niceness() -> int:
    import os

    return os.nice(0)


def test_rl_steps_sync_kill_and_resume(tiny_qwen_moe, tmp_path):
    import shutil

    import ray

    from rl.observe.sink import read_metrics
    from rl.setup import start_run
    from rl.run import run

    run_dir, run_dir2 = tmp_path / "run", tmp_path / "run_resumed"
    cfg = _cfg(tiny_qwen_moe, run_dir, steps=3)
    if ray.is_initialized():  # an instance an earlier test left in this process (with Ray's own niceness): the run starts its own
        ray.shutdown()
    parts = start_run(cfg)
    try:
        # A run's workers start at niceness 0 (rl/placement.py), not Ray's default 15.
        assert ray.get(ray.remote(num_cpus=0)(_niceness).remote()) == 0
        w0 = ray.get(parts.policy.trainer.export_weights(1024.0)[0])
        # Kill the rollout worker after the first RL step: the dispatcher must restart it with the latest weights.
        orig_rollout, orig_checkpoint = parts.rollouts.rollout, parts.checkpoints.save
        calls = {"n": 0}

        def rollout_then_kill(tasks, step):
            out = orig_rollout(tasks, step)
            calls["n"] += 1
            if calls["n"] == 1:  # RL step 0 (the "before" eval runs episodes directly, not through rollout)
                ray.kill(parts.rollouts.engine.handles[0], no_restart=True)
            return out

        def checkpoint_then_copy(state, sampler):
            orig_checkpoint(state, sampler)
            if state.step == 2:  # "kill" the run here: a copy of its directory as it stands after the step-2 checkpoint
                shutil.copytree(run_dir, run_dir2)

        parts.rollouts.rollout, parts.checkpoints.save = rollout_then_kill, checkpoint_then_copy
        summary = run(cfg, parts)
        w1 = ray.get(parts.policy.trainer.export_weights(1024.0)[0])
        restarts = parts.rollouts.engine.restarts
    finally:
        parts.close()

    from rl.weights import unpack_bucket

    a, b = dict(unpack_bucket(w0)), dict(unpack_bucket(w1))
    changed = [n for n in a if not (a[n] == b[n]).all()]
    assert len(changed) > len(a) // 2, "training did not change the weights"
    assert restarts == [1], restarts
    rows = read_metrics(run_dir)
    rl_rows = [r for r in rows if "reward/mean/terminal" in r]
    assert [r["step"] for r in rl_rows] == [0, 1, 2]
    for r in rl_rows:
        assert "reward/mean/browse" in r and "tokens/response_mean/terminal" in r
        # the engine serves exactly the trainer's weights (fp32 both sides), checked every 2nd step
        if r["step"] % 2 == 0:
            assert r["mismatch/logprob_abs_mean"] < 2e-3, r["mismatch/logprob_abs_mean"]
            assert r["mismatch/logprob_abs_max"] < 2e-2
        else:
            assert "mismatch/logprob_abs_mean" not in r and "mismatch/logprob_abs_max" not in r
        assert r["policy/version"] >= 1
        assert r["trainer/world_size"] == 1 and r["rollout/max_staleness_seen"] == 0  # sync mode: no lag
        assert 0.2 < r["train/rss_gb"] < 24  # the trainer rank's resident memory, read from /proc each update
        # the step-time breakdown is logged every step and adds up
        parts = r["time/rollout_generate_s"] + r["time/rollout_tools_s"] + r["time/rollout_grade_s"]
        assert parts == pytest.approx(r["time/rollout_s"], rel=1e-6) and r["time/train_s"] > 0 and r["time/sync_s"] > 0
    assert len(summary["before"]) == 2 and len(summary["after"]) == 2
    assert (run_dir / "eval_table.txt").exists()
    assert json.loads((run_dir / "checkpoint" / "meta.json").read_text())["step"] == 3

    # Resume the copy killed after step 2: it continues at step 2 (no SFT again) and, with per-request
    # seeds and fp32 on both sides, reproduces the uninterrupted run's step 2.
    meta2 = json.loads((run_dir2 / "checkpoint" / "meta.json").read_text())
    assert meta2["step"] == 2
    cfg2 = _cfg(tiny_qwen_moe, run_dir2, steps=3)
    parts2 = start_run(cfg2)
    try:
        assert parts2.state.step == 2 and parts2.state.policy_version == meta2["policy_version"]
        run(cfg2, parts2)
    finally:
        parts2.close()
    # the resumed run's "before" arm is the first run's evaluation, not one of its step-2 checkpoint
    assert (run_dir2 / "eval_before.json").read_text() == (run_dir / "eval_before.json").read_text()
    resumed = [r for r in read_metrics(run_dir2) if "reward/mean/terminal" in r]
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert json.loads((run_dir2 / "checkpoint" / "meta.json").read_text())["step"] == 3
    want, got = rl_rows[2], resumed[2]
    exact = [k for k in want if k.split("/")[0] in ("reward", "success", "tokens", "turns", "episodes")]
    assert exact and {k: got[k] for k in exact} == {k: want[k] for k in exact}
    close = [k for k in want if k.startswith(("loss/", "policy/ratio", "train/grad_norm"))]
    assert close
    for k in close:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
