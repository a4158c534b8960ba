"""Benchmark the environment layer (terminal-v0 on the bwrap backend), figures side by side in one run.

    .venv/bin/python scripts/bench_envs.py [--n 200] [--episodes 28] [--concurrency 8]

Prints:
  * the framework's per-step cost: `bash("true")` through `ToolEnv.step` (argument parsing,
    thread hop, clipping, bookkeeping) vs the same command through `Sandbox.run` directly vs a
    plain host `subprocess.run`, median / p95 and ratios;
  * whole terminal-v0 episodes (reset with set-up + reference solution + grade with its fresh
    sandboxes + close), sequential vs `--concurrency` episodes on one asyncio loop: episodes per
    minute and per-family episode latency.
The raw sandbox latency and open/close costs are in scripts/bench_sandbox.py. Needs root (the
backend does); nothing here is a test.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import envs  # noqa: E402
from envs.play import ScriptedPolicy, run_episode  # noqa: E402
from envs.sandbox.bwrap import BwrapBackend  # noqa: E402
from envs.terminal.domain import AGENT_ENV  # noqa: E402
from jointrl.records import Message, ToolCall  # noqa: E402


def stats_ms(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return 1000 * statistics.median(xs), 1000 * xs[min(len(xs) - 1, int(0.95 * len(xs)))]


def bench_step(backend: BwrapBackend, n: int) -> None:
    task = envs.generate_tasks("terminal-v0", "train", 0, 1)[0]
    env = envs.make("terminal-v0", backend=backend, limits=task.limits.__class__(max_turns=n + 10))
    plain, direct, stepped = [], [], []

    async def go():
        await env.reset(task)
        sb = env.domain.sandbox
        for i in range(n):
            t = time.perf_counter()
            subprocess.run(["bash", "-c", "true"], capture_output=True, env=AGENT_ENV)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            sb.run("true", timeout_s=10, env=AGENT_ENV, cwd=sb.workdir_inside)
            direct.append(time.perf_counter() - t)
            msg = Message(role="assistant", tool_calls=(ToolCall(id=f"c{i}", name="bash", arguments='{"command": "true"}'),))
            t = time.perf_counter()
            await env.step(msg)
            stepped.append(time.perf_counter() - t)
    asyncio.run(go())
    env.close()
    (pm, pp), (dm, dp), (sm, sp) = stats_ms(plain), stats_ms(direct), stats_ms(stepped)
    print(f"per-step cost of bash('true'), {n} calls each (median / p95 ms):")
    print(f"  host subprocess.run : {pm:7.2f} / {pp:7.2f}")
    print(f"  Sandbox.run         : {dm:7.2f} / {dp:7.2f}   ({dm / pm:.2f}x host median)")
    print(f"  ToolEnv.step(bash)  : {sm:7.2f} / {sp:7.2f}   ({sm / dm:.2f}x Sandbox.run median; framework adds {sm - dm:.2f} ms)")


async def _episodes(backend: BwrapBackend, tasks, concurrency: int) -> tuple[float, dict[str, list[float]], list[float]]:
    sem = asyncio.Semaphore(concurrency)
    per_family: dict[str, list[float]] = defaultdict(list)
    rewards: list[float] = []

    async def one(task):
        async with sem:
            env = envs.make("terminal-v0", backend=backend)
            t = time.perf_counter()
            try:
                tr = await run_episode(env, task, ScriptedPolicy(env.reference(task)))
            finally:
                env.close()
            per_family[task.private["family"]].append(time.perf_counter() - t)
            rewards.append(tr.grade.reward)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t) for t in tasks))
    return time.perf_counter() - t0, per_family, rewards


def bench_episodes(backend: BwrapBackend, n_episodes: int, concurrency: int) -> None:
    tasks = envs.generate_tasks("terminal-v0", "train", 0, n_episodes)
    print(f"\nterminal-v0 reference episodes ({n_episodes}, {os.cpu_count()} cores): reset + solution + grade + close")
    results = {}
    for c in (1, concurrency):
        wall, per_family, rewards = asyncio.run(_episodes(backend, tasks, c))
        results[c] = (wall, per_family)
        ok = sum(r == 1.0 for r in rewards)
        print(f"  concurrency {c:2d}: {60 * n_episodes / wall:6.0f} episodes/min  ({wall:.1f} s wall, {ok}/{len(rewards)} scored 1)")
    print(f"  speed-up {concurrency} vs 1: {results[1][0] / results[concurrency][0]:.2f}x")
    print("  per-family episode latency at concurrency 1 (median ms):")
    fams = results[1][1]
    print("   " + "  ".join(f"{k}={1000 * statistics.median(v):.0f}" for k, v in sorted(fams.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="calls per variant in the per-step benchmark")
    ap.add_argument("--episodes", type=int, default=28, help="episodes (two per family with the default 28)")
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    backend = BwrapBackend()
    bench_step(backend, args.n)
    bench_episodes(backend, args.episodes, args.concurrency)


if __name__ == "__main__":
    main()
