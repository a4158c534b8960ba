"""Benchmark the bwrap sandbox: command round-trip latency vs plain subprocess, and episode throughput.

    sudo .venv/bin/python scripts/bench_sandbox.py [--n 300] [--concurrency 8] [--episodes 8]

Prints, side by side in one run:
  * round-trip latency (median / p95) of `echo hi` through `BwrapSandbox.run` vs
    `subprocess.run(["bash", "-c", "echo hi"])` on the host, and the ratio;
  * what a fresh namespace costs (open, a namespace restart after a timeout, close);
  * episodes per minute with N concurrent sandboxes, one episode = open + 5 commands + close.
Needs root (the backend does); nothing here is a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from envs.sandbox.base import SandboxLimits  # noqa: E402
from envs.sandbox.bwrap import BwrapBackend  # noqa: E402

EPISODE_COMMANDS = (
    "ls -la",
    "printf 'alpha\\nbeta\\ngamma\\n' > notes.txt",
    "grep -c a notes.txt",
    "sort -r notes.txt | head -1",
    "python3 -c 'print(sum(range(100)))'",
)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def fmt_ms(xs: list[float]) -> str:
    return f"median {1e3 * statistics.median(xs):7.2f} ms   p95 {1e3 * pct(xs, 0.95):7.2f} ms"


def bench_latency(backend: BwrapBackend, n: int) -> None:
    sb = backend.open(limits=SandboxLimits())
    try:
        for _ in range(10):  # warm both paths
            sb.run("echo hi", timeout_s=10)
            subprocess.run(["bash", "-c", "echo hi"], capture_output=True)
        sand, plain = [], []
        for _ in range(n):  # interleaved, so machine load hits both alike
            t0 = time.perf_counter()
            r = sb.run("echo hi", timeout_s=10)
            sand.append(time.perf_counter() - t0)
            assert r.stdout == "hi\n"
            t0 = time.perf_counter()
            p = subprocess.run(["bash", "-c", "echo hi"], capture_output=True)
            plain.append(time.perf_counter() - t0)
            assert p.stdout == b"hi\n"
        restarts = []
        for _ in range(max(5, n // 20)):
            t0 = time.perf_counter()
            sb._signal_pid1()
            with sb._lock:
                sb._kill_namespace()
                sb._start()
            restarts.append(time.perf_counter() - t0)
    finally:
        sb.close()
    opens, closes = [], []
    for _ in range(max(5, n // 20)):
        t0 = time.perf_counter()
        s = backend.open()
        opens.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s.close()
        closes.append(time.perf_counter() - t0)
    print(f"round trip `echo hi`, n={n}")
    print(f"  plain subprocess : {fmt_ms(plain)}")
    print(f"  bwrap sandbox    : {fmt_ms(sand)}")
    print(f"  ratio sandbox/plain: median {statistics.median(sand) / statistics.median(plain):.2f}x   "
          f"p95 {pct(sand, 0.95) / pct(plain, 0.95):.2f}x")
    print("namespace costs (not paid per command)")
    print(f"  open()           : {fmt_ms(opens)}")
    print(f"  restart after kill: {fmt_ms(restarts)}")
    print(f"  close()          : {fmt_ms(closes)}")


def bench_episodes(backend: BwrapBackend, concurrency: int, episodes_per_worker: int) -> None:
    durations: list[float] = []
    cmd_times: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(episodes_per_worker):
            t0 = time.perf_counter()
            sb = backend.open(limits=SandboxLimits(workdir_mb=32))
            try:
                for cmd in EPISODE_COMMANDS:
                    c0 = time.perf_counter()
                    r = sb.run(cmd, timeout_s=30)
                    with lock:
                        cmd_times.append(time.perf_counter() - c0)
                    if r.exit_code != 0:
                        errors.append(f"{cmd}: {r.exit_code} {r.stderr[:200]}")
            finally:
                sb.close()
            with lock:
                durations.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    total = concurrency * episodes_per_worker
    print(f"episodes: {concurrency} concurrent sandboxes, {total} episodes of open + {len(EPISODE_COMMANDS)} commands"
          f" + close, on {os.cpu_count()} cores")
    print(f"  throughput       : {60 * total / wall:7.0f} episodes/min   ({wall:.1f} s wall)")
    print(f"  episode latency  : {fmt_ms(durations)}")
    print(f"  command latency  : {fmt_ms(cmd_times)}  (under contention)")
    if errors:
        print(f"  ERRORS ({len(errors)}): {errors[:3]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="round trips per path for the latency figures")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=8, help="episodes per concurrent worker")
    args = ap.parse_args()
    backend = BwrapBackend()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    bench_latency(backend, args.n)
    bench_episodes(backend, args.concurrency, args.episodes)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
