#!/usr/bin/env python
"""Trainer-at-scale figures, side by side in one run (ratios: this machine is shared and noisy).

1. Tokens/s of one RL update on 1 vs 2 DeepSpeed ranks (Ray actors in a placement group, ZeRO-1),
   same batch. On 2 shared cores two ranks cannot be faster than one: the figure shows what the
   sharding, the padded micro-batches and the gloo all-reduce cost on top of the compute.
2. The KL reference's logprob pass and the critic's update, each as a fraction of the policy update
   of the same step (targets: reference <= 0.35x).
3. Per-rank resident memory after one update under ZeRO-3, 2 ranks vs 1 (`--memory-model`, default
   `small`, 74M parameters, so weights + grads + Adam moments dominate the process): the model's
   share is the rank's RSS less what its process held before building the model (target <= 0.6x).

    .venv/bin/python scripts/bench_train_scale.py [--iters 3] [--memory-model small]

`scripts/bench_train.py --scale` runs the same.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _batch(vocab: int, B: int, T: int, seed: int = 0):
    import torch

    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate
    from rl.types import Episode

    g = torch.Generator().manual_seed(seed)
    eps = []
    for i in range(B):
        ids = torch.randint(11, vocab, (T,), generator=g).tolist()
        mask = [0] * (T // 2) + [1] * (T - T // 2)
        eps.append(Episode(task_id=f"t{i // 4}", domain="d", group_id=f"g{i // 4}", token_ids=tuple(ids), loss_mask=tuple(mask),
                           rollout_logprobs=tuple(-2.0 * m for m in mask), messages=(), reward=float(i % 2)))
    batch = collate(eps, [1.0 if i % 2 else -1.0 for i in range(B)], domains=("d",))
    w, _ = aggregation_weights("token_mean", batch.loss_mask_BT > 0)
    return batch.with_(loss_weights_BT=w)


def _group(init: str, ranks: int, zero: int, *, reference: bool = False, critic: bool = False):
    from rl.objective import RLObjective
    from rl.trainer.critic import CriticSpec
    from rl.trainer.group import TrainerGroup
    from rl.trainer.policy import TrainerSpec

    env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "TORCH_EXTENSIONS", "HF_", "TRANSFORMERS_"))}
    g = TrainerGroup.start(init, TrainerSpec(zero_stage=zero, lr=1e-5, micro_batch_size=4, routing_replay="auto"),
                           RLObjective(kl_coef=0.01 if reference else 0.0), num_ranks=ranks, env=env,
                           critic=CriticSpec(micro_batch_size=4, zero_stage=zero) if critic else None)
    if reference:
        g.load_reference(init)
    return g


def bench_ranks(iters: int) -> dict:
    from model.shipped import build_random_checkpoint, load_shipped_config
    from rl.config import AlgorithmSection
    from rl.train import with_advantages

    tmp = Path(tempfile.mkdtemp(prefix="jointrl-scale-"))
    init = str(build_random_checkpoint("tiny", tmp / "tiny", seed=0))
    batch = _batch(load_shipped_config("tiny").vocab_size, 16, 256)
    out: dict = {}
    for ranks in (1, 2):
        g = _group(init, ranks, 1, reference=True, critic=True)
        try:
            values = g.values(batch)
            b, _ = with_advantages(batch, AlgorithmSection(advantage="gae"), values)
            g.rl_step(b)  # warm-up (first-call allocations)
            walls, ms = [], []
            for _ in range(iters):
                t0 = time.perf_counter()
                ms.append(g.rl_step(b))
                walls.append(time.perf_counter() - t0)
            wall = statistics.median(walls)
            m = ms[walls.index(sorted(walls)[len(walls) // 2])]
            out[ranks] = {"tok_s": m["train/tokens"] / wall, "wall_s": wall,
                          "update_s": m["train/step_s"], "ref_s": m.get("train/ref_logprob_s", 0.0),
                          "critic_s": m.get("value/step_s", 0.0), "old_s": m["train/old_logprob_s"]}
        finally:
            g.kill()
    return out


def bench_memory(model: str) -> dict:
    from model.shipped import build_random_checkpoint, load_shipped_config

    tmp = Path(tempfile.mkdtemp(prefix="jointrl-mem-"))
    init = str(build_random_checkpoint(model, tmp / model, seed=0))
    batch = _batch(load_shipped_config(model).vocab_size, 4, 128)
    out: dict = {}
    for ranks in (1, 2):
        g = _group(init, ranks, 3)
        try:
            g.rl_step(batch)
            out[ranks] = g.memory()
        finally:
            g.kill()
    return out


def run(iters: int = 3, memory_model: str = "small") -> None:
    os.environ.setdefault("JOINTRL_CACHE", str(ROOT / ".cache"))
    from rl.paths import setup_cache_env

    setup_cache_env()
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=os.environ.get("RAY_TMPDIR"))
    try:
        r = bench_ranks(iters)
        print(f"\n== RL update, tiny HybridMoe, 16 x 256 tokens, ZeRO-1, median of {iters}")
        print(f"{'ranks':>5} {'tokens/s':>10} {'step s':>8} {'update s':>9} {'old-lp s':>9} {'ref s':>7} {'critic s':>9}")
        for n, x in r.items():
            print(f"{n:>5} {x['tok_s']:>10.0f} {x['wall_s']:>8.2f} {x['update_s']:>9.2f} {x['old_s']:>9.2f} {x['ref_s']:>7.2f} {x['critic_s']:>9.2f}")
        print(f"2 ranks / 1 rank tokens/s: {r[2]['tok_s'] / r[1]['tok_s']:.2f}x   (2 shared cores: <= 1x expected)")
        for n in (1, 2):
            print(f"{n} rank(s): reference pass {r[n]['ref_s'] / r[n]['update_s']:.2f}x the update (target <= 0.35x), "
                  f"critic update {r[n]['critic_s'] / r[n]['update_s']:.2f}x the update")
        mem = bench_memory(memory_model)
        print(f"\n== per-rank resident memory after one ZeRO-3 update, {memory_model} HybridMoe")
        for n, per_rank in mem.items():
            for i, m in enumerate(per_rank):
                print(f"{n} rank(s), rank {i}: peak RSS {m['peak_rss_mb']:.0f} MB, of which model/optimizer/engine "
                      f"{m['model_peak_rss_mb']:.0f} MB (process start {m['start_rss_mb']:.0f} MB)")
        one = mem[1][0]["model_peak_rss_mb"]
        two = max(m["model_peak_rss_mb"] for m in mem[2])
        print(f"2 ranks / 1 rank, model share of peak RSS per rank: {two / one:.2f}x (target <= 0.6x)")
    finally:
        ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--memory-model", default="small")
    a = p.parse_args()
    run(a.iters, a.memory_model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
