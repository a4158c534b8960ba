#!/usr/bin/env python
"""Image input cost, text-only vs one 64 x 64 image per prompt, side by side in one run (docs/multimodal.md).

1. Rollout: generated tokens/s of the vLLM engine (tiny random HybridMoe, bf16 on CPU) on N prompts of
   `--prompt-tokens` text tokens, `--new-tokens` generated per prompt (ignore_eos), against the same prompts
   each with one 64 x 64 PNG (16 placeholder positions more) on an engine built for images. The text-only
   engine is built text-only (`max_images_per_prompt=0`), as a text run builds it. Goal >= 0.8x.
2. Trainer: `PolicyTrainer` old-logprob pass + `train_step` tokens/s (fp32, ZeRO-1, the RL objective) on B
   episodes of T tokens whose prompts hold one 64 x 64 image (16 of the T tokens), against the same
   episodes with text tokens at those positions. Goal >= 0.8x.

Engines and trainers run one at a time (each in its own process: vLLM and DeepSpeed hold process-wide state).

    .venv/bin/python scripts/bench_multimodal.py [--prompts 32] [--prompt-tokens 96] [--new-tokens 32]
                                                 [--batch 8] [--seq 256] [--iters 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IMG_PX = 64  # one 64 x 64 image per prompt: 16 patches at the shipped patch size 16


def _png(seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 256, (IMG_PX, IMG_PX, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _checkpoint() -> str:
    os.environ.setdefault("JOINTRL_CACHE", str(ROOT / ".cache"))
    from model.shipped import build_random_checkpoint
    from rl.paths import cache_root

    return str(build_random_checkpoint("tiny", Path(cache_root()) / "bench" / "multimodal_tiny", seed=0))


def bench_rollout(with_images: bool, n: int, prompt_tokens: int, new_tokens: int, reps: int) -> dict:
    from model.chat import IMAGE_ID
    from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine
    from rl.types import TokenImage

    import numpy as np

    ckpt = _checkpoint()
    patches = (IMG_PX // 16) ** 2
    eng = RolloutEngine(EngineConfig(model_path=ckpt, dtype="auto", max_model_len=prompt_tokens + patches + new_tokens + 8,
                                     kv_cache_gib=0.5, max_images_per_prompt=1 if with_images else 0))
    try:
        rs = np.random.RandomState(0)
        reqs = []
        for i in range(n):
            text = [int(x) for x in rs.randint(20, 8000, size=prompt_tokens)]
            if with_images:
                toks = text[:8] + [IMAGE_ID] * patches + text[8:]
                images = (TokenImage(_png(i), 8, patches),)
            else:
                toks, images = text, ()
            reqs.append(GenerateRequest(prompt_token_ids=tuple(toks), max_tokens=new_tokens, temperature=1.0, seed=i,
                                        ignore_eos=True, images=images))
        eng.generate(reqs[:4])  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = eng.generate(reqs)
            times.append(time.perf_counter() - t0)
        gen = sum(len(r.token_ids) for r in out)
        best = sorted(times)[len(times) // 2]
        return {"gen_tok_per_s": gen / best, "prompt_tokens": len(reqs[0].prompt_token_ids), "startup_s": eng.startup_s}
    finally:
        eng.shutdown()


def _episodes(vocab: int, B: int, T: int, with_images: bool):
    import random

    from model.chat import IMAGE_ID
    from rl.types import Episode, TokenImage

    rng = random.Random(0)
    patches = (IMG_PX // 16) ** 2
    eps = []
    for i in range(B):
        ids = [rng.randrange(11, vocab) for _ in range(T)]
        images = ()
        if with_images:
            ids[8:8 + patches] = [IMAGE_ID] * patches
            images = (TokenImage(_png(i), 8, patches),)
        eps.append(Episode(task_id=f"t{i}", domain="d", group_id=f"g{i // 4}", token_ids=tuple(ids),
                           loss_mask=tuple([0] * (T // 4) + [1] * (T - T // 4)), rollout_logprobs=tuple([-2.0] * T),
                           messages=(), reward=float(i % 2), images=images))
    return eps


def bench_trainer(B: int, T: int, iters: int) -> dict:
    os.environ.setdefault("JOINTRL_CACHE", str(ROOT / ".cache"))
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.algos import aggregation_weights
    from rl.objective import RLObjective
    from rl.trainer.batch import collate
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.manual_seed(0)
    cfg = load_shipped_config("tiny")
    tmp = tempfile.mkdtemp()
    HybridMoeForCausalLM(cfg).save_pretrained(tmp)
    tr = PolicyTrainer(tmp, TrainerSpec(zero_stage=1, lr=1e-5, micro_batch_size=4), RLObjective())
    arms = {}
    for name, with_images in (("text only", False), ("one 64x64 image per episode", True)):
        b = collate(_episodes(cfg.vocab_size, B, T, with_images), [(-1.0) ** i for i in range(B)], domains=("d",))
        w, _ = aggregation_weights("token_mean", b.loss_mask_BT > 0)
        arms[name] = b.with_(loss_weights_BT=w)

    def step(b):
        old, routes = tr.compute_logprobs(b)
        tr.train_step(b.with_(old_logprobs_BT=old, routed_experts_BTLK=routes, routes_from="trainer"))

    times: dict[str, list[float]] = {n: [] for n in arms}
    for b in arms.values():
        step(b)  # warm-up
    for _ in range(iters):  # the two arms alternate, so load changes on the shared machine hit both alike
        for name, b in arms.items():
            t0 = time.perf_counter()
            step(b)
            times[name].append(time.perf_counter() - t0)
    return {n: int(arms[n].attention_mask_BT.sum()) / sorted(t)[len(t) // 2] for n, t in times.items()}


def _in_child(fn, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--trainer-only", action="store_true")
    a = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    t = _in_child(bench_trainer, a.batch, a.seq, a.iters)
    names = list(t)
    print(f"\nTrainer, tiny HybridMoe fp32, {a.batch} x {a.seq} tokens, old-logprob pass + train_step (median of {a.iters}, arms alternating):")
    for n in names:
        print(f"  {n:32s} {t[n]:8.1f} tok/s")
    print(f"  ratio {t[names[1]] / t[names[0]]:.2f}x (goal >= 0.8x)")
    if a.trainer_only:
        return 0
    r_text = _in_child(bench_rollout, False, a.prompts, a.prompt_tokens, a.new_tokens, a.reps)
    r_img = _in_child(bench_rollout, True, a.prompts, a.prompt_tokens, a.new_tokens, a.reps)
    print(f"\nRollout, tiny HybridMoe bf16, {a.prompts} prompts x {a.new_tokens} generated tokens (median of {a.reps}):")
    print(f"  text only ({r_text['prompt_tokens']}-token prompts, text-only engine)  {r_text['gen_tok_per_s']:8.1f} tok/s")
    print(f"  + one {IMG_PX}x{IMG_PX} image ({r_img['prompt_tokens']}-token prompts)         {r_img['gen_tok_per_s']:8.1f} tok/s"
          f"   {r_img['gen_tok_per_s'] / r_text['gen_tok_per_s']:.2f}x (goal >= 0.8x)")
    print(f"  engine start-up: text-only {r_text['startup_s']:.1f} s, with images {r_img['startup_s']:.1f} s")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
