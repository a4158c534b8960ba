"""The learning check: RL on top of a supervised warm start makes the policy better on held-out tasks.

Runs configs/basics.yaml end to end through the real stack (Ray actors, a vLLM engine serving the tiny
HybridMoe, a DeepSpeed trainer, bubblewrap sandboxes): SFT warm start on terminal-basics-v0 reference
trajectories, held-out evaluation, a short GRPO run, held-out evaluation again. Both evaluations sample
at the training temperature with the same per-request seeds, so the comparison is paired task by task.
Exits 1 unless the paired gain is at least MIN_GAIN with paired t >= MIN_T, the RL steps kept groups
with signal, and the engine served the trained weights (small engine-vs-trainer logprob gap).

About 10 minutes on 2 cores, so the default test run skips it; CI runs it as
tests/scripts/test_check_learning.py (`pytest -m learning --run-learning`). Its latest figures are in
docs/training.md, "Learning check".

    .venv/bin/python scripts/check_learning.py [--run-dir runs/basics-check] [KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import sys

MIN_GAIN = 0.05     # absolute held-out success gain (fraction of episodes)
MIN_T = 3.0         # paired t over held-out tasks (one-sided p ~ 0.002 at ~100 degrees of freedom)
MAX_MISMATCH = 0.05  # engine-vs-trainer mean |logprob| gap after a sync


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/basics-check")
    ap.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE applied to configs/basics.yaml")
    args = ap.parse_args(argv)

    from rl.config import load_config
    from rl.evaluate import paired_diff
    from rl.observe.sink import read_metrics
    from rl.run import run

    cfg = load_config("basics.yaml", [f"run_dir={args.run_dir}", *args.overrides])
    summary = run(cfg)
    (before,), (after,) = summary["before"], summary["after"]
    p = paired_diff(before.task_success, after.task_success)
    rows = [r for r in read_metrics(args.run_dir) if "reward/mean/terminal" in r]
    kept = sum(r.get("rollout/groups_kept", 0.0) for r in rows)
    gaps = [r["mismatch/logprob_abs_mean"] for r in rows if "mismatch/logprob_abs_mean" in r]
    print(f"held-out success {before.success:.3f} -> {after.success:.3f} (gain {p.mean:+.3f}, 95% CI "
          f"[{p.ci_low:+.3f}, {p.ci_high:+.3f}], paired t {p.t:.2f}, {before.n} tasks x {before.samples} samples); "
          f"{len(rows)} RL steps, {kept:.0f} groups kept, max logprob gap {max(gaps, default=float('nan')):.4f}")
    failures = []
    if p.mean < MIN_GAIN or p.t < MIN_T:
        failures.append(f"gain {p.mean:+.3f} / t {p.t:.2f} below the bar (gain >= {MIN_GAIN}, t >= {MIN_T})")
    if len(rows) != cfg.trainer.steps or kept <= 0:
        failures.append(f"{len(rows)} of {cfg.trainer.steps} steps logged, {kept:.0f} groups kept")
    if not gaps or max(gaps) >= MAX_MISMATCH:
        failures.append(f"engine-vs-trainer logprob gap {max(gaps, default=float('nan')):.4f} >= {MAX_MISMATCH}")
    for f in failures:
        print(f"check_learning: FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
