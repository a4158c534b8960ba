"""Every long phase shows progress: the held-out evaluation has a bar that moves per finished episode (with
its ETA) and log lines at its start and end; the SFT control arm's bar counts its time budget.

The runtime here is a stand-in for the engine side only: its `run_groups` makes each task's real environment
(terminal-basics-v0, a bubblewrap sandbox), resets it and closes it, as the agent loop does, and scores the
episode 1 when the task id is even (a vLLM engine would need minutes to start; tests/rl/test_train_e2e.py
runs the real one through the same `evaluate`)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import envs
from jointrl.records import Task
from rl.config import load_config
from rl.types import Episode, SftStepResult


class EngineSideStandIn:
    """Rollouts whose episodes are an environment reset each (no engine)."""

    def make_env(self, task):
        return envs.make("terminal-basics-v0")

    def run_groups(self, tasks, group_size, temperature=None, seed=0):
        out = []
        for i, t in enumerate(tasks):
            group = []
            for _ in range(group_size):
                env = self.make_env(t)
                try:
                    asyncio.run(env.reset(t))
                finally:
                    env.close()
                group.append(Episode(task_id=t.id, domain="terminal", group_id=t.id, token_ids=(1,), loss_mask=(1,),
                                     rollout_logprobs=(0.0,), messages=(), reward=float(i % 2 == 0), num_turns=1))
            out.append(group)
        return out


def test_evaluation_shows_a_bar_per_episode_and_logs_its_start_and_end(tmp_path, monkeypatch, capsys):
    from rl.evaluate import evaluate
    from rl.log import setup_logging

    monkeypatch.setenv("JOINTRL_PROGRESS", "1")
    setup_logging("INFO")
    cfg = load_config(None, ["eval.n_per_domain=3", "eval.samples=2", "eval.temperature=1.0"])
    tasks = [Task.from_row(r) for r in envs.tasks("terminal-basics-v0", "heldout", seed=0, n=3)]
    rollouts = EngineSideStandIn()
    pools = SimpleNamespace(domains=("terminal",), heldout={"terminal": tasks})
    rows = evaluate(rollouts, pools, cfg.eval, tmp_path, "before", default_n=2, weights=cfg.envs.weights)
    err = capsys.readouterr().err
    assert rows[0].n == 3 and rows[0].samples == 2 and abs(rows[0].success - 2 / 3) < 1e-9
    assert "held-out evaluation 'before': 6 episodes over 1 domain(s)" in err
    assert "eval before" in err and "6/6" in err and ("ep/s" in err or "s/ep" in err)
    assert "held-out evaluation 'before': 6 episodes in" in err
    assert "make_env" not in vars(rollouts)  # the counting wrapper is gone afterwards
    assert json.loads((tmp_path / "eval_before.json").read_text())[0]["n"] == 3


def test_the_control_arm_bar_counts_its_seconds(tmp_path, monkeypatch, capsys):
    import time

    from rl.sft import sft_train

    monkeypatch.setenv("JOINTRL_PROGRESS", "1")
    cfg = load_config(None, [f"run_dir={tmp_path}", "trainer.micro_batch_size=1"])
    eps = [Episode(task_id="t", domain="terminal", group_id="g", token_ids=(1, 2), loss_mask=(0, 1), rollout_logprobs=(0.0, 0.0),
                   messages=(), reward=1.0)]
    policy = SimpleNamespace(set_lr=lambda lr: None, sft_step=lambda b: time.sleep(0.3) or SftStepResult(nll=0.5),
                             batch_of=lambda c, a: c, refresh_versions=lambda: 0)
    m = sft_train(policy, eps, cfg.trainer, tmp_path, seed=cfg.model.seed, seconds=2.0, label="sft_control")
    err = capsys.readouterr().err
    assert m.steps >= 3
    assert "sft_control" in err and "/2 [" in err and "step " in err and "nll 0.500" in err
