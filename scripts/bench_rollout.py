"""Rollout throughput and weight-sync latency, side by side in one run.

Generated tokens/s, same model, same batch, same sampling (temperature 1, per-request seeds,
`ignore_eos` so every path generates exactly `--new` tokens per sequence):
  ray_worker   RolloutWorker Ray actor (engine in the actor), one remote call per batch
  engine       RolloutEngine.generate in this process (continuous-batching stepper)
  bare_vllm    vllm.LLM.generate on the very same engine object (the baseline)
  hf           transformers generate (do_sample), batch of the same prompts
Weight update: the full state dict (checkpoint format, `--bucket-mb` buckets) pushed in place,
in-process and through the Ray actor (object refs), reported as ms per MB.

Usage: .venv/bin/python scripts/bench_rollout.py [--batches 16 64] [--new 64] [--layers 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-only", default=None, help=argparse.SUPPRESS)  # internal: HF timing in a child process
    args = ap.parse_args()
    if args.hf_only:
        return hf_only(args)

    import numpy as np
    import torch

    from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint
    from rl.weights import make_buckets, to_checkpoint_format, total_bytes, unpack_bucket

    tmp = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    spec = TinyModelSpec(kind="qwen3_moe", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                         num_kv_heads=2, head_dim=64, moe_intermediate_size=256, num_experts=args.experts, top_k=2)
    ckpt = build_tiny_checkpoint(tmp / "ckpt", spec, init_std=0.02)
    from safetensors.torch import load_file

    n_params = sum(t.numel() for t in load_file(str(ckpt / "model.safetensors")).values())
    print(f"model: Qwen3-MoE {n_params / 1e6:.1f}M params, {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-2, fp32")

    rs = np.random.RandomState(0)
    max_b = max(args.batches)
    prompts = [tuple(int(x) for x in rs.randint(10, 500, size=args.prompt_len)) for _ in range(max_b)]

    def reqs(b):
        return [GenerateRequest(prompt_token_ids=p, max_tokens=args.new, temperature=1.0, seed=i, ignore_eos=True) for i, p in enumerate(prompts[:b])]

    cfg = EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=args.prompt_len + args.new + 8, kv_cache_gib=1.0)
    rows: dict[str, dict[int, float]] = {}

    def timed(name, b, fn, reps=2):
        fn()  # warm-up (first batch of a size pays one-off costs)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            n = fn()
            best = min(best, time.perf_counter() - t0)
        rows.setdefault(name, {})[b] = n / best

    # ---- Ray actor first (its engine idles while the in-process one runs)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    from rl.rollout.worker import rollout_worker_actor

    actor = rollout_worker_actor(num_cpus=0).remote(cfg)
    ray.get(actor.health.remote())
    for b in args.batches:
        timed("ray_worker", b, lambda b=b: sum(len(r.token_ids) for r in ray.get(actor.generate.remote(reqs(b)))))

    # ---- in-process engine and bare vLLM on the same engine
    eng = RolloutEngine(cfg)
    from vllm import SamplingParams

    def bare(b):
        sps = [SamplingParams(max_tokens=args.new, temperature=1.0, seed=i, logprobs=0, ignore_eos=True, detokenize=False) for i in range(b)]
        outs = eng.llm.generate([{"prompt_token_ids": list(p)} for p in prompts[:b]], sps, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    for b in args.batches:
        timed("engine", b, lambda b=b: sum(len(r.token_ids) for r in eng.generate(reqs(b))))
        timed("bare_vllm", b, lambda b=b: bare(b))

    # ---- weight update latency
    state = load_file(str(ckpt / "model.safetensors"))
    upd = []
    for _ in range(3):
        buckets = make_buckets(state, "qwen3_moe", args.bucket_mb)
        mb = total_bytes(buckets) / 2**20
        t0 = time.perf_counter()
        for bk in buckets:
            eng.update_weights(unpack_bucket(bk))
        upd.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    refs = [ray.put(bk) for bk in buckets]
    put_ms = (time.perf_counter() - t0) * 1e3
    ray_upd = []
    for v in range(3):
        t0 = time.perf_counter()
        ray.get(actor.update_weights.remote(refs, v + 10))
        ray_upd.append((time.perf_counter() - t0) * 1e3)

    # ---- HF generate, in a fresh process: vLLM pinned this one's torch to 1 thread and bound its memory
    if not args.skip_hf:
        import json
        import subprocess

        eng.shutdown()
        cmd = [sys.executable, __file__, "--hf-only", str(ckpt), "--new", str(args.new), "--prompt-len", str(args.prompt_len),
               "--batches", *map(str, args.batches)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "VLLM_", "KMP_"))}  # vLLM's 1-thread pinning
        hf_rates = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1])
        rows["hf"] = {int(k): v for k, v in hf_rates.items()}

    print(f"\ngenerated tok/s ({args.new} new tokens, prompt {args.prompt_len}, best of 2 after a warm-up):")
    print(f"{'path':<12}" + "".join(f"{'B=' + str(b):>12}" for b in args.batches) + "".join(f"{'vs bare B=' + str(b):>16}" for b in args.batches))
    for name, r in rows.items():
        print(f"{name:<12}" + "".join(f"{r[b]:>12.0f}" for b in args.batches)
              + "".join(f"{r[b] / rows['bare_vllm'][b]:>15.2f}x" for b in args.batches))
    print(f"\nweight update, {mb:.1f} MB in {len(buckets)} bucket(s) of <= {args.bucket_mb:g} MB:")
    print(f"  in-process   {min(upd):8.1f} ms  = {min(upd) / mb:.2f} ms/MB   (runs: {', '.join(f'{x:.0f}' for x in upd)})")
    print(f"  ray worker   {min(ray_upd):8.1f} ms  = {min(ray_upd) / mb:.2f} ms/MB   (object refs; ray.put of all buckets {put_ms:.0f} ms once)")
    ray.shutdown()


def hf_only(args: argparse.Namespace) -> None:
    import json

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    rs = np.random.RandomState(0)
    prompts = [[int(x) for x in rs.randint(10, 500, size=args.prompt_len)] for _ in range(max(args.batches))]
    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(args.hf_only, dtype=torch.float32).eval()

    def gen(b: int) -> int:
        ids = torch.tensor(prompts[:b])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * b

    rates = {}
    for b in args.batches:
        gen(b)  # warm-up
        t0 = time.perf_counter()
        n = gen(b)
        rates[b] = n / (time.perf_counter() - t0)
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
