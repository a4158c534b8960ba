"""The learning check: RL on top of a supervised warm start makes the policy better on held-out tasks.

configs/basics.yaml end to end through the real stack (Ray actors, a vLLM engine serving the tiny
HybridMoe, a DeepSpeed trainer, bubblewrap sandboxes): SFT warm start on terminal-basics-v0
reference trajectories, held-out evaluation, a short GRPO run, held-out evaluation again. Both
evaluations sample at the training temperature with the same per-request seeds, so the
comparison is paired task by task; the test asks for a paired improvement that noise at this
sample size does not produce (t statistic over tasks) and a minimum absolute gain.
"""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow

MIN_GAIN = 0.05     # absolute held-out success gain (fraction of episodes)
MIN_T = 3.0         # paired t statistic over held-out tasks (one-sided p ~ 0.002 at ~100 degrees of freedom)


def paired_t(before: list[float], after: list[float]) -> float:
    d = [a - b for a, b in zip(after, before)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean / math.sqrt(var / n) if var > 0 else (math.inf if mean > 0 else 0.0)


def test_paired_t_reference():
    assert paired_t([0, 0, 0, 0], [1, 1, 1, 1]) == math.inf
    assert paired_t([0, 1, 0, 1], [0, 1, 0, 1]) == 0.0
    # d = [1, 0, 1, 0]: mean 0.5, sample sd sqrt(1/3), t = 0.5 / sqrt(1/12) = sqrt(3)
    assert paired_t([0, 0, 0, 0], [1, 0, 1, 0]) == pytest.approx(math.sqrt(3))


def test_rl_beats_sft_alone_on_heldout(tmp_path):
    from rl.config import load_config
    from rl.metrics import read_metrics
    from rl.train import run

    cfg = load_config("basics.yaml", [f"run_dir={tmp_path / 'run'}"])
    summary = run(cfg)
    (before,), (after,) = summary["before"], summary["after"]
    assert before.n == after.n == cfg.eval.n_per_domain and len(before.task_success) == before.n
    gain = after.success - before.success
    t = paired_t(list(before.task_success), list(after.task_success))
    report = (f"held-out success {before.success:.3f} -> {after.success:.3f} (gain {gain:+.3f}, paired t {t:.2f}, "
              f"{before.n} tasks x {before.samples} samples)")
    print(report)
    assert gain >= MIN_GAIN and t >= MIN_T, report
    # the RL steps trained on real signal and the engine served the trained weights
    rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean/terminal" in r]
    assert len(rows) == cfg.trainer.steps
    assert sum(r.get("rollout/groups_kept", 0.0) for r in rows) > 0
    assert max(r["mismatch/logprob_abs_mean"] for r in rows if "mismatch/logprob_abs_mean" in r) < 0.05
