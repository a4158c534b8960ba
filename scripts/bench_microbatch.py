#!/usr/bin/env python
"""Trainer micro-batching, side by side in one run: rows in batch order at the step's full width vs rows
grouped by length and each micro-batch cut to its longest row (rl/trainer/batch.py: `micro_rows`,
`micro_batches`, what the trainer does).

The batch looks like an agent RL step: most episodes short (one turn), some long (a retry after a
malformed call, a multi-turn episode), so the step is padded to a long one. Each arm runs in a fresh
process (its peak resident size is its own) and times `PolicyTrainer.train_step` with the RL objective;
the figures are tokens/s, the peak resident size during the steps less the size after loading, and the
resident size after the last step (the trainer actor hands free heap pages back after each step with
`trim_heap`; the bench does the same). Printed as ratios to the batch-order arm (this machine is shared).

    .venv/bin/python scripts/bench_microbatch.py [--model smollm2-135m-moe|tiny] [--seqs 48] [--short 380]
        [--long 900] [--long-share 0.3] [--micro-batch 8] [--frozen-layers 15] [--steps 2] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts._spawn import in_fresh_process  # noqa: E402

ARMS = ("batch order, full width", "length-grouped, cut")


def _batch(vocab: int, args):
    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate
    from rl.types import Episode

    rng = random.Random(0)
    eps = []
    for i in range(args.seqs):
        long = rng.random() < args.long_share
        T = args.long if long else args.short
        T += rng.randrange(-T // 10, T // 10 + 1)  # ragged within each kind too
        gen = T // 4 if not long else T // 2     # the generated part: the retry adds generated turns
        eps.append(Episode(task_id=f"t{i}", domain="d", group_id=f"g{i // 8}", token_ids=tuple(rng.randrange(11, vocab) for _ in range(T)),
                           loss_mask=tuple([0] * (T - gen) + [1] * gen), rollout_logprobs=tuple([-2.0] * T), messages=(),
                           reward=float(i % 2)))
    b = collate(eps, [(-1.0) ** i for i in range(len(eps))], domains=("d",))
    w, _ = aggregation_weights("seq_mean_token_mean", b.loss_mask_BT > 0)
    return b.with_(loss_weights_BT=w)


def _arm(name: str, model_dir: str, args, out) -> None:
    import resource

    import torch

    from rl.objective import RLObjective
    from rl.trainer import batch as batch_mod
    from rl.trainer.actor import _rss_mb, trim_heap
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.set_num_threads(args.threads)
    if name == ARMS[0]:  # the former micro-batching: consecutive rows, every micro-batch as wide as the step
        batch_mod.micro_rows = lambda b, size: [list(range(s, min(s + batch_mod._plan(size).rows, b.num_seqs)))
                                                for s in range(0, b.num_seqs, batch_mod._plan(size).rows)]
        batch_mod.TrainBatch.narrowed = lambda self: self
    tr = PolicyTrainer(model_dir, TrainerSpec(zero_stage=1, lr=1e-6, micro_batch_size=args.micro_batch, frozen_layers=args.frozen_layers),
                       RLObjective(router_aux_coef=0.001))
    batch = _batch(tr.module.config.vocab_size, args)
    tokens = int(batch.attention_mask_BT.sum())
    tr.train_step(batch)  # warm-up (DeepSpeed's first step allocates the optimizer state)
    trim_heap()
    base_mb = _rss_mb()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tr.train_step(batch)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    trim_heap()
    out.put({"tok_per_s": tokens * args.steps / dt, "step_s": dt / args.steps, "tokens": tokens, "width": batch.input_ids_BT.shape[1],
             "peak_gb": peak / 1024, "peak_over_base_gb": (max(peak, peak_before) - base_mb) / 1024,
             "after_gb": _rss_mb() / 1024})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-moe", help="a pullable name, a checkpoint directory, or 'tiny' (the shipped HybridMoe)")
    ap.add_argument("--seqs", type=int, default=48)
    ap.add_argument("--short", type=int, default=380)
    ap.add_argument("--long", type=int, default=900)
    ap.add_argument("--long-share", type=float, default=0.3)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--frozen-layers", type=int, default=15)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    os.environ.setdefault("JOINTRL_CACHE", str(ROOT / ".cache"))
    from rl.paths import setup_cache_env

    setup_cache_env()
    if args.model == "tiny":
        from model.modeling import HybridMoeForCausalLM
        from model.shipped import load_shipped_config

        model_dir = tempfile.mkdtemp()
        HybridMoeForCausalLM(load_shipped_config("tiny")).save_pretrained(model_dir)
        args.frozen_layers = 0
    else:
        from rl.config import load_config, resolve_pullable

        cfg = resolve_pullable(load_config(str(ROOT / "configs" / "learning_cad.yaml"), [f"model.arch={args.model}"]))
        model_dir = cfg.model.arch
    res = {}
    for name in ARMS:
        res[name] = in_fresh_process(_arm, (name, model_dir, args), f"arm {name!r}", "bench_microbatch")
        print(f"  {name}: {res[name]['step_s']:.1f} s per step", flush=True)
    base = res[ARMS[0]]
    print(f"\n{Path(str(model_dir)).name}: {args.seqs} sequences ({base['tokens']} real tokens, padded width {base['width']}), "
          f"{args.long_share:.0%} long ({args.long} tokens) / short ({args.short}), micro-batch {args.micro_batch}, "
          f"{args.steps} steps per arm, {args.threads} threads")
    print(f"{'arm':<26} {'tokens/s':>9} {'ratio':>6} {'peak - after load (GB)':>23} {'ratio':>6} {'RSS after step (GB)':>20}")
    for name, r in res.items():
        print(f"{name:<26} {r['tok_per_s']:>9.1f} {r['tok_per_s'] / base['tok_per_s']:>5.2f}x {r['peak_over_base_gb']:>23.2f} "
              f"{r['peak_over_base_gb'] / max(base['peak_over_base_gb'], 1e-9):>5.2f}x {r['after_gb']:>20.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
