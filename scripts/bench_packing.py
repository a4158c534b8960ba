"""Shared-prefix packing (trainer.prefix_sharing) against padded rows, side by side in one run: one RL
update (old-policy logprob pass + forward/backward + optimizer step, the work of a GRPO step's train
phase) through the project's trainer (rl.trainer.policy.PolicyTrainer, DeepSpeed ZeRO-1, router hooks
and R2 routes as in a run) on the upcycled SmolLM2-MoE.

The batch is GRPO-shaped: `--groups` prompts of `--prompt` tokens, `--group-size` samples each with
`--gen` generated tokens (lengths vary +-25% around it, and the samples of a group share their first 4
generated tokens half the time, as sampled answers often do). Each arm runs in a fresh process, the
arms round-robin (`--rounds`) so load swings on this shared machine hit both; the median is printed.

    .venv/bin/python scripts/bench_packing.py                       # an agent-episode shape (terminal-basics-like)
    .venv/bin/python scripts/bench_packing.py --groups 4 --group-size 4 --prompt 271 --gen 56 --micro 2   # bench_trl's shape
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._spawn import in_fresh_process  # noqa: E402


def grpo_batch(groups: int, group_size: int, prompt: int, gen: int, vocab: int, seed: int = 0):
    """A collated GRPO batch (rl.trainer.batch.collate) of random tokens with the shapes above."""
    import random

    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate
    from rl.types import Episode

    rng = random.Random(seed)
    eps, adv = [], []
    for g in range(groups):
        p = [rng.randrange(10, vocab - 10) for _ in range(prompt)]
        opening = [rng.randrange(10, vocab - 10) for _ in range(4)]
        for i in range(group_size):
            n = max(4, int(gen * rng.uniform(0.75, 1.25)))
            out = [rng.randrange(10, vocab - 10) for _ in range(n)]
            if i % 2 == 0:
                out[:4] = opening
            eps.append(Episode(task_id=f"t{g}", domain="d", group_id=f"g{g}", token_ids=tuple(p + out),
                               loss_mask=tuple([0] * prompt + [1] * n), rollout_logprobs=tuple([0.0] * prompt + [-2.0] * n),
                               messages=(), reward=float(i % 2)))
            adv.append(1.0 if i % 2 else -1.0)
    batch = collate(eps, adv, domains=("d",))
    w, _ = aggregation_weights("seq_mean_token_mean", batch.loss_mask_BT > 0)
    return batch.with_(loss_weights_BT=w)


def _arm(mode: str, model_dir: str, args, out) -> None:
    import resource

    import torch

    from rl.objective import RLObjective
    from rl.trainer.actor import trim_heap
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.set_num_threads(args.threads)
    spec = TrainerSpec(zero_stage=1, lr=1e-6, micro_batch_size=args.micro, dtype=args.dtype, routing_replay="r2",
                       prefix_sharing=mode, frozen_layers=args.frozen_layers)
    t = PolicyTrainer(model_dir, spec, RLObjective())
    batch = grpo_batch(args.groups, args.group_size, args.prompt, args.gen, t.module.config.vocab_size)

    def update() -> dict:
        old, routes = t.compute_logprobs(batch)
        return t.train_step(batch.with_(old_logprobs_BT=old, routed_experts_BTLK=routes, routes_from="trainer"))

    update()  # warm-up: allocator, optimizer state
    trim_heap()
    t0 = time.perf_counter()
    m = update()
    out.put({"step_s": time.perf_counter() - t0, "forward_tokens": m["train/forward_tokens"], "tokens": m["train/tokens"],
             "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 ** 2})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-moe", help="a pullable model name or a checkpoint dir")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=330, help="prompt tokens shared by a group")
    ap.add_argument("--gen", type=int, default=130, help="mean generated (and tool) tokens per sample")
    ap.add_argument("--micro", type=int, default=8, help="micro-batch size (rows)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frozen-layers", type=int, default=15, help="trainer.frozen_layers (the real-policy configs freeze 15 of 30)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    os.environ.setdefault("JOINTRL_PROGRESS", "0")
    from model import hub

    model_dir = str(hub.pull(args.model)) if args.model in hub.names() else args.model
    arms = ("off", "on")
    res: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for a in arms:
            res[a].append(in_fresh_process(_arm, (a, model_dir, args), f"arm prefix_sharing={a}", "bench_packing"))
            print(f"  round {r} prefix_sharing={a}: {res[a][-1]['step_s']:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    step = {a: statistics.median(x["step_s"] for x in res[a]) for a in arms}
    print(f"\nRL update (old-logprob pass + forward/backward + step), {args.groups} groups x {args.group_size} samples, "
          f"prompt {args.prompt} + ~{args.gen} generated tokens, micro-batch {args.micro}, {args.dtype}, {args.threads} threads, "
          f"{args.frozen_layers} layers frozen, "
          f"{Path(model_dir).name}; median of {args.rounds}; load average at the end {os.getloadavg()[0]:.1f}")
    print(f"{'trainer.prefix_sharing':<24} {'real tokens':>12} {'computed':>10} {'update s':>9} {'real tok/s':>11} {'vs off':>7} {'peak GB':>8}")
    for a in arms:
        x = res[a][0]
        print(f"{a:<24} {x['tokens']:>12.0f} {x['forward_tokens']:>10.0f} {step[a]:>9.2f} {x['tokens'] / step[a]:>11.1f} "
              f"{step['off'] / step[a]:>6.2f}x {max(y['peak_gb'] for y in res[a]):>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
