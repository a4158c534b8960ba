"""`jointrl train` with two DeepSpeed ranks under ZeRO-3 in sync mode, a KL loss to the reference and PPO
with GAE and the critic, on configs/basics.yaml's tiny HybridMoe and domain.

The step batch (2 tasks x 2 samples) is one micro-batch, so the second rank holds only padding every
step: it must still join each collective pass the step makes (the R2 route-recording pass the reference
needs, the update, the critic's update, the MoE telemetry's sum; tests/rl/trainer/test_group_padding.py
checks the update itself). Through the CLI, as a user starts it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def test_two_rank_zero3_sync_ppo_with_kl_reference_through_the_cli(tmp_path):
    from rl.observe.sink import read_metrics

    run_dir = tmp_path / "r"
    cmd = [str(Path(sys.executable).with_name("jointrl")), "train", "configs/basics.yaml", "name=ranks", f"run_dir={run_dir}",
           "trainer.sft_steps=0", "trainer.steps=2", "trainer.tasks_per_step=2", "algorithm.group_size=2",
           "algorithm.dynamic_sampling=off", "eval.n_per_domain=2", "eval.samples=1", "trainer.num_workers=2",
           "trainer.zero_stage=3", "algorithm.kl_coef=0.05", "algorithm.advantage=gae"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trained = [r for r in read_metrics(run_dir) if "trainer/world_size" in r]
    assert len(trained) == 2, trained
    assert all(r["trainer/world_size"] == 2 for r in trained)
    assert all("value/loss" in r and "value/explained_var" in r for r in trained)  # GAE: the critic trains
    # KL(pi_old || pi_ref) before each update: 0 at the first step (the reference is the policy as RL
    # starts), above 0 once an update has moved the policy.
    assert all(r["kl/ref_mean"] >= 0 for r in trained) and trained[-1]["kl/ref_mean"] > 0
    assert all(r["kl/coef"] == 0.05 for r in trained)
