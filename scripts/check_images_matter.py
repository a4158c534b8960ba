"""Does the policy use the images? cad-v0 on the tiny HybridMoe, RL with `rollout.image_pixels: real` against
`blank` (the same images greyed out: same sizes, same placeholder tokens, no picture), same seeds and budget.

Each arm is one run of the real stack (Ray, a bf16 vLLM engine taking images, a DeepSpeed trainer, bubblewrap
sandboxes, the CAD grading workers), in its own process, one arm after the other:

1. a short SFT warm start on reference trajectories of train tasks, so the policy writes tool calls at all
   (the arms' SFT data are the same: a reference episode carries the prompt's image placeholder as text, no
   pixels, in both arms, so both arms leave SFT with the same weights);
2. held-out evaluation (the first `--heldout` held-out tasks x `--samples`, at the training temperature, fixed
   per-request seeds), in the arm's own pixels: the prompt's target views (the 320 x 320 sheet) real or grey;
3. `--steps` GRPO steps, then the same held-out evaluation again.

The parent prints both arms' held-out reward and success, before and after RL, side by side, and the paired
difference of the after-RL reward per task (real minus blank; mean, 95% CI, paired t). A policy that uses the
pictures would show real > blank after RL; the arms' "before" rows differ only by what the untrained policy
does with grey instead of real pixels.

    .venv/bin/python scripts/check_images_matter.py [--run-root runs/images-matter] [--sft-steps 20] [--steps 3]
        [--heldout 18] [--samples 2]

What it does not do: decide anything (it reports; the tiny random model is not expected to use images), or
run the arms at once (one heavy run at a time on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("real", "blank")


def arm_overrides(arm: str, run_dir: Path, a: argparse.Namespace) -> list[str]:
    return [
        f"name=images-matter-{arm}", f"run_dir={run_dir}",
        "envs.weights={cad: 1.0}", "envs.env_ids={cad: cad-v0}", "envs.default_tier={cad: low}", "envs.max_turns=2",
        "envs.sandbox_slots=2",
        # the prompt's sheet and one render_view; the sheet alone is 400 of the context's tokens
        "rollout.max_images_per_prompt=2", f"rollout.image_pixels={arm}", "rollout.max_model_len=2048",
        "rollout.max_new_tokens_per_turn=128", "rollout.temperature=1.0", "rollout.max_concurrent_episodes=8",
        "algorithm.group_size=4", "algorithm.dynamic_sampling=filter",
        f"trainer.sft_steps={a.sft_steps}", "trainer.sft_tasks_per_domain=9", f"trainer.steps={a.steps}",
        "trainer.tasks_per_step=3", "trainer.micro_batch_size=4", "trainer.checkpoint_every=0",
        f"eval.n_per_domain={a.heldout}", f"eval.samples={a.samples}", "eval.temperature=1.0",
        "logging.wandb_mode=disabled",
    ]


def held_out(parts, cfg) -> dict:
    """Per held-out task: mean reward and success over its samples; what the episodes showed and did."""
    import numpy as np

    tasks = parts.pools.heldout["cad"][:cfg.eval.n_per_domain]
    groups = parts.rollouts.run_groups(tasks, cfg.eval.samples, temperature=cfg.eval.temperature, seed=cfg.eval.seed)
    eps = [e for g in groups for e in g]
    return {"task_ids": [t.id for t in tasks],
            "task_reward": [float(np.mean([e.reward for e in g])) for g in groups],
            "task_success": [float(np.mean([e.reward >= 1.0 for e in g])) for g in groups],
            "images_per_episode": float(np.mean([len(e.images) for e in eps])),
            "image_tokens_per_episode": float(np.mean([sum(im.length for im in e.images) for e in eps])),
            "submitted": float(np.mean([e.metrics.get("check/submitted", 0.0) for e in eps])),
            "valid": float(np.mean([e.metrics.get("check/valid", 0.0) for e in eps])),
            "grade_errors": sum(e.grade_error is not None for e in eps)}


def run_arm(arm: str, run_dir: Path, a: argparse.Namespace) -> dict:
    from rl.config import load_config
    from rl.run import loop_config
    from rl.setup import start_run
    from rl.sft import sft_warm_start
    from rl.train import Loop, rl_steps

    cfg = load_config("tiny.yaml", arm_overrides(arm, run_dir, a))
    t0 = time.perf_counter()
    with start_run(cfg) as parts:
        sft = {}
        if cfg.trainer.sft_steps:
            sft = sft_warm_start(parts.policy, parts.sft.episodes(parts.rollouts), cfg.trainer, parts.run_dir,
                                 seed=cfg.model.seed, steps=cfg.trainer.sft_steps).as_metrics()
            parts.sync.push()
        parts.policy.prepare_reference(parts.rollouts.policy_version)
        before = held_out(parts, cfg)
        loop = Loop(rollouts=parts.rollouts, sampler=parts.sampler, policy=parts.policy, sync=parts.sync,
                    checkpoints=parts.checkpoints, sink=parts.sink, domains=parts.pools.domains)
        rl_s = rl_steps(loop, loop_config(cfg), parts.state).rl_seconds
        after = held_out(parts, cfg)
    from rl.observe.sink import read_metrics

    rows = [r for r in read_metrics(run_dir) if "policy/version" in r]
    return {"arm": arm, "before": before, "after": after, "rl_seconds": rl_s, "wall_s": time.perf_counter() - t0,
            "sft_loss": sft.get("sft/nll"), "groups_kept": sum(r.get("rollout/groups_kept", 0.0) for r in rows),
            "train_reward": [r.get("reward/mean/cad") for r in rows]}


def report(res: dict[str, dict]) -> str:
    import numpy as np

    from rl.evaluate import paired_diff

    r, b = res["real"], res["blank"]
    n = len(r["after"]["task_reward"])
    lines = [f"held-out cad-v0, {n} tasks, tiny HybridMoe: RL with real vs blank prompt views (same seeds, budget)",
             f"{'':28s} {'real':>20s} {'blank':>20s}"]

    def row(name, f):
        lines.append(f"{name:28s} {f(r):>20s} {f(b):>20s}")

    for when in ("before", "after"):
        row(f"reward, {when} RL", lambda x, w=when: f"{np.mean(x[w]['task_reward']):+.4f}")
        row(f"success, {when} RL", lambda x, w=when: f"{np.mean(x[w]['task_success']):.3f}")
        row(f"submitted, {when} RL", lambda x, w=when: f"{x[w]['submitted']:.3f}")
        row(f"valid solid, {when} RL", lambda x, w=when: f"{x[w]['valid']:.3f}")
    row("images / episode (after)", lambda x: f"{x['after']['images_per_episode']:.2f}")
    row("image tokens / ep (after)", lambda x: f"{x['after']['image_tokens_per_episode']:.0f}")
    row("SFT nll, last step", lambda x: "-" if x["sft_loss"] is None else f"{x['sft_loss']:.3f}")
    row("RL groups kept", lambda x: f"{x['groups_kept']:.0f}")
    row("train reward per step", lambda x: " ".join("-" if v is None else f"{v:+.2f}" for v in x["train_reward"]))
    row("arm wall time (s)", lambda x: f"{x['wall_s']:.0f}")
    assert r["after"]["task_ids"] == b["after"]["task_ids"], "the arms evaluated different tasks"
    for when in ("before", "after"):
        p = paired_diff(b[when]["task_reward"], r[when]["task_reward"])
        lines.append(f"paired difference of {when}-RL reward, real - blank: {p.mean:+.4f} (95% CI [{p.ci_low:+.4f}, "
                     f"{p.ci_high:+.4f}], paired t {p.t:.2f}, {n} tasks)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-root", default="runs/images-matter", help="each arm runs in RUN_ROOT/<arm>")
    ap.add_argument("--sft-steps", type=int, default=20, help="supervised warm-start steps (0: none)")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per arm")
    ap.add_argument("--heldout", type=int, default=18, help="held-out tasks per evaluation")
    ap.add_argument("--samples", type=int, default=2, help="episodes per held-out task")
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm in this process
    a = ap.parse_args(argv)
    root = Path(a.run_root)
    if a.arm:
        out = run_arm(a.arm, root / a.arm, a)
        (root / f"{a.arm}.json").write_text(json.dumps(out, indent=1))
        return 0
    root.mkdir(parents=True, exist_ok=True)
    res = {}
    for arm in ARMS:  # one after the other, each in a fresh process (Ray, the engine, the trainer)
        cmd = [sys.executable, __file__, "--arm", arm, "--run-root", str(root), "--sft-steps", str(a.sft_steps),
               "--steps", str(a.steps), "--heldout", str(a.heldout), "--samples", str(a.samples)]
        if subprocess.run(cmd).returncode != 0:
            print(f"check_images_matter: the {arm} arm failed (log above)", file=sys.stderr)
            return 1
        res[arm] = json.loads((root / f"{arm}.json").read_text())
    text = report(res)
    (root / "report.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
