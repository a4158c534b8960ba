"""Held-out evaluation throughput: how the driver hands batches to the engine, and the engine's threads.

One process, one terminal-basics held-out workload (--tasks tasks x --samples samples at temperature 1,
the same seeds in every arm) through the real agent loop, sandboxes and an in-process RolloutEngine on
the chosen checkpoint. Arms, side by side:
  to_thread   batches handed over with asyncio.to_thread (the loop's default pool: cores + 4 threads)
  threaded    batches handed over by ThreadedGenerate (one thread per episode that can be waiting)
  threaded_2t the same with the engine on 2 threads (rollout.threads_per_worker: 2)
Printed per arm: episodes/s, generated tokens/s, the prefix-cache hit rate (vLLM's own counters),
success, and episodes/s as a ratio to the first arm.

    .venv/bin/python scripts/bench_eval.py [--model smollm2-135m-moe] [--tasks 16] [--samples 2] [--config configs/learning_terminal.yaml]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_arm(cfg, model_dir: Path, env_id: str, tasks, samples: int, threads: int, handoff: str) -> dict[str, float]:
    import envs
    from rl.rollout.agent_loop import BatchingGenerator, ThreadedGenerate, run_groups
    from rl.rollout.engine import RolloutEngine
    from rl.setup import build_codec, engine_config_for, loop_settings_for

    codec = build_codec(cfg.model, model_dir)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, threads_per_worker=threads))
    ecfg = engine_config_for(cfg, model_dir, codec)
    engine = RolloutEngine(dataclasses.replace(ecfg, extra_llm_kwargs={**ecfg.extra_llm_kwargs, "disable_log_stats": False}))
    max_concurrent = cfg.rollout.max_concurrent_episodes

    async def go():
        async def to_thread(reqs):
            return await asyncio.to_thread(engine.generate, reqs)

        async with ThreadedGenerate(engine.generate, max_concurrent) as threaded:
            generate_batch = threaded if handoff == "threaded" else to_thread
            return await run_groups(tasks, samples, lambda _t: envs.make(env_id), BatchingGenerator(generate_batch), codec.tokenizer,
                                    codec, loop_settings_for(cfg, codec, temperature=1.0), max_concurrent=max_concurrent, seed=0)

    t0 = time.perf_counter()
    groups = asyncio.run(go())
    dt = time.perf_counter() - t0
    metrics = {m.name: m for m in engine.llm.get_metrics()}
    engine.shutdown()
    eps = [e for g in groups for e in g]

    def value(name: str) -> float:
        m = metrics.get(name)
        return float(getattr(m, "value", 0.0)) if m is not None else 0.0

    queries, hits = value("vllm:prefix_cache_queries"), value("vllm:prefix_cache_hits")
    gen_tokens = sum(sum(e.loss_mask) for e in eps)
    return {"episodes": len(eps), "seconds": dt, "eps_per_s": len(eps) / dt, "gen_tok_per_s": gen_tokens / dt,
            "success": sum(e.reward >= 1.0 for e in eps) / max(len(eps), 1),
            "prefix_hit": hits / queries if queries else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/learning_terminal.yaml")
    ap.add_argument("--model", default=None, help="checkpoint dir or pullable name (default: the config's model.arch)")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--arms", default="to_thread,threaded,threaded_2t")
    args = ap.parse_args(argv)

    from dataclasses import replace

    import envs
    from jointrl.records import Task
    from rl.config import load_config, resolve_pullable

    overrides = [f"model.arch={args.model}"] if args.model else []
    cfg = resolve_pullable(load_config(args.config, overrides))
    model_dir = Path(cfg.model.arch)
    domain, env_id = next(iter(cfg.envs.env_ids.items()))
    tier = cfg.envs.default_tier.get(domain, "low")
    rows = list(envs.tasks(env_id, "heldout", seed=cfg.envs.seed))[: args.tasks]
    tasks = [replace(Task.from_row(row), domain=domain, thinking=tier) for row in rows]
    arms = {"to_thread": (1, "to_thread"), "threaded": (1, "threaded"), "threaded_2t": (2, "threaded")}
    results = {}
    for name in args.arms.split(","):
        threads, handoff = arms[name]
        results[name] = run_arm(cfg, model_dir, env_id, tasks, args.samples, threads, handoff)
        print(f"  {name}: {results[name]['episodes']} episodes in {results[name]['seconds']:.1f} s", flush=True)
    base = results[next(iter(results))]["eps_per_s"]
    print(f"\n{env_id} held-out, {len(tasks)} tasks x {args.samples} samples, {model_dir.name}, "
          f"max_concurrent_episodes {cfg.rollout.max_concurrent_episodes}")
    print(f"{'arm':<12} {'episodes/s':>10} {'gen tok/s':>10} {'prefix hit':>10} {'success':>8} {'ratio':>7}")
    for name, r in results.items():
        print(f"{name:<12} {r['eps_per_s']:>10.3f} {r['gen_tok_per_s']:>10.1f} {r['prefix_hit']:>10.1%} {r['success']:>8.3f} "
              f"{r['eps_per_s'] / base:>6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
