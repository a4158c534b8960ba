"""Agent jobs: throughput per worker count, queue + database overhead per job, and pulls from object storage, in one run.

    .venv/bin/python scripts/bench_jobs.py [--jobs 16] [--overhead-jobs 8]

Figures, side by side (the machine is shared and noisy: compare the ratios):
1. jobs/min at 1, 2 and 4 agent workers on terminal-basics-v0 (`jointrl jobs serve --policy-url`, one
   tiny HybridMoe policy engine shared by all workers; timed after a warm-up round, so worker start-up
   is not counted);
2. queue + database overhead per job: every call a worker and the API make to the store and the broker
   for one job (submit, claim, events, completion, ack), timed, vs the episode's own wall time, and the
   end-to-end job vs the same episode called directly (target: overhead <= 5% of the episode);
3. cold start from object storage: pulling the 8-shard checkpoint from moto's local S3 server in
   parallel vs sequentially (target >= 2x), next to the engine's own start-up from local disk.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from rl.jobs.broker import Broker, RedisProcess  # noqa: E402
from rl.jobs.policy import wait_healthy  # noqa: E402
from rl.jobs.records import JobsConfig, JobSpec  # noqa: E402
from rl.jobs.server import free_port  # noqa: E402
from rl.jobs.store import open_store  # noqa: E402

ENV = "terminal-basics-v0"
LOOP = dict(max_turns=2, max_new_tokens_per_turn=16)


class Timed:
    """Times every method call of the object it wraps (the store or the broker)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed


def start_policy(model: Path, tmp: Path) -> tuple[subprocess.Popen, str, float]:
    """The policy server, with a fresh key in this process's $JOINTRL_POLICY_API_KEY: the jobs servers started
    below with --policy-url, their workers and the in-process runner all read it from there."""
    import secrets

    from rl.jobs.guard import POLICY_KEY_ENV

    os.environ[POLICY_KEY_ENV] = secrets.token_urlsafe(24)
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "rl.jobs.policy", str(model), "--port", str(port)],
                            stdout=open(tmp / "policy.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600, proc, api_key=os.environ[POLICY_KEY_ENV])
    return proc, url, time.perf_counter() - t0


def bench_overhead(policy_url: str, redis_url: str, tmp: Path, n: int) -> dict[str, float]:
    """Per job, interleaved: the episode called directly, then the same job through store + broker + worker."""
    from rl.jobs.worker import EpisodeRunner, Worker

    cfg = JobsConfig(redis_url=redis_url, db_url=f"sqlite:///{tmp}/overhead.sqlite", stream="bench:overhead", **LOOP)
    store, broker = Timed(open_store(cfg.db_url)), Timed(Broker(cfg.redis_url, cfg.stream))
    runner = EpisodeRunner(cfg, policy_url)
    episode_s: list[float] = []
    orig_run = runner.run

    async def timed_run(*a: Any, **kw: Any):
        t0 = time.perf_counter()
        try:
            return await orig_run(*a, **kw)
        finally:
            episode_s.append(time.perf_counter() - t0)

    runner.run = timed_run  # type: ignore[method-assign]
    worker = Worker("bench", cfg, store, broker, runner)  # type: ignore[arg-type]

    async def direct(spec: JobSpec) -> None:
        await orig_run("direct", spec, lambda kind, data: None)
        await runner.policy.aclose()

    asyncio.run(direct(JobSpec(env=ENV, index=n)))  # warm-up: task generation, tokenizer, engine prefix
    direct_s, job_s, ovh_s = [], [], []
    for i in range(n):
        spec = JobSpec(env=ENV, index=i)
        t0 = time.perf_counter()
        asyncio.run(direct(spec))
        direct_s.append(time.perf_counter() - t0)
        store.seconds = broker.seconds = 0.0
        t0 = time.perf_counter()
        jid = store.create_job(spec)  # what POST /v1/jobs does
        store.set_entry(jid, broker.enqueue(jid))
        worker.serve(max_jobs=1)
        job_s.append(time.perf_counter() - t0)
        # the event writes happen inside the episode's wall time; they are store time, so they count as overhead
        ovh_s.append(store.seconds + broker.seconds)
        assert store.get(jid).status == "done", store.get(jid)
    return {"direct_s": statistics.median(direct_s), "job_s": statistics.median(job_s), "episode_s": statistics.median(episode_s),
            "overhead_s": statistics.median(ovh_s), "overhead_frac": statistics.median(o / e for o, e in zip(ovh_s, episode_s)),
            "job_vs_direct": statistics.median(j / d for j, d in zip(job_s, direct_s))}


def bench_throughput(model: Path, policy_url: str, tmp: Path, workers: int, n_jobs: int) -> float:
    redis_port = free_port()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    db = f"sqlite:///{tmp}/tp{workers}/jobs.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "jobs", "serve", str(model), "--port", str(port), "--workers", str(workers),
                             "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--db", db, "--policy-url", policy_url,
                             "--max-turns", str(LOOP["max_turns"]), "--max-new-tokens", str(LOOP["max_new_tokens_per_turn"])],
                            stdout=open(tmp / f"serve{workers}.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "jobs server did not start"
                time.sleep(0.3)

        def run_round(indices: range) -> float:
            t0 = time.perf_counter()
            ids = [httpx.post(f"{url}/v1/jobs", json={"env": ENV, "index": i}, timeout=30).json()["id"] for i in indices]
            end = time.monotonic() + 900
            while httpx.get(f"{url}/health", timeout=10).json()["counts"].get("done", 0) < indices.stop and time.monotonic() < end:
                time.sleep(0.2)
            assert all(httpx.get(f"{url}/v1/jobs/{j}").json()["status"] == "done" for j in ids)
            return time.perf_counter() - t0

        run_round(range(0, 2 * workers))  # warm-up: every worker up and through one job
        secs = run_round(range(2 * workers, 2 * workers + n_jobs))
        return n_jobs / secs * 60
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def bench_pull(model: Path, tmp: Path, reps: int) -> dict[str, float]:
    from rl.weights.objstore import export_sharded, pull

    port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        m = export_sharded(model, "s3://bench/tiny", num_shards=8)
        size = sum(f.size for f in m.files)
        par, seq = [], []
        for r in range(reps):  # alternate, so drift in the machine's load hits both alike
            for parallel, out in ((8, par), (1, seq)):
                dest = tmp / f"pull-{parallel}-{r}"
                st = pull("s3://bench/tiny", dest, parallel=parallel)
                assert st.downloaded == len(m.files)
                out.append(st.seconds)
        return {"mb": size / 1e6, "parallel_s": statistics.median(par), "sequential_s": statistics.median(seq)}
    finally:
        moto.terminate()
        moto.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16, help="timed jobs per worker count")
    ap.add_argument("--overhead-jobs", type=int, default=8)
    ap.add_argument("--pull-reps", type=int, default=3)
    ap.add_argument("--workers", default="1,2,4")
    args = ap.parse_args()
    from model.shipped import build_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as t:
        tmp = Path(t)
        model = build_random_checkpoint("tiny", tmp / "tiny", seed=0)
        pulls = bench_pull(model, tmp, args.pull_reps)
        policy, policy_url, engine_s = start_policy(model, tmp)
        redis_port = free_port()
        rp = RedisProcess(redis_port)
        try:
            ovh = bench_overhead(policy_url, f"redis://127.0.0.1:{redis_port}/0", tmp, args.overhead_jobs)
            tput = {w: bench_throughput(model, policy_url, tmp, w, args.jobs) for w in (int(x) for x in args.workers.split(","))}
        finally:
            rp.stop()
            policy.terminate()
            policy.wait(timeout=60)
    base = tput[min(tput)]
    print(f"\n== agent jobs on {ENV} (tiny HybridMoe policy, {LOOP['max_turns']} turns x {LOOP['max_new_tokens_per_turn']} tokens), "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print("| workers | jobs/min | vs 1 worker |\n| --- | --- | --- |")
    for w, v in tput.items():
        print(f"| {w} | {v:.1f} | {v / base:.2f}x |")
    print(f"\nqueue + database per job: {ovh['overhead_s'] * 1e3:.1f} ms vs episode {ovh['episode_s'] * 1e3:.0f} ms "
          f"= {ovh['overhead_frac'] * 100:.2f}% (target <= 5%); whole job (submit -> done, in-process worker) vs the episode called "
          f"directly: {ovh['job_s']:.3f} s vs {ovh['direct_s']:.3f} s = {ovh['job_vs_direct']:.3f}x (median of {args.overhead_jobs})")
    print(f"cold start: pull of 8 shards ({pulls['mb']:.1f} MB) from local S3: parallel {pulls['parallel_s']:.3f} s vs sequential "
          f"{pulls['sequential_s']:.3f} s = {pulls['sequential_s'] / pulls['parallel_s']:.2f}x faster (target >= 2x); engine start "
          f"from local disk {engine_s:.1f} s, so from S3 (parallel pull + start) {1 + pulls['parallel_s'] / engine_s:.3f}x local")
    return 0


if __name__ == "__main__":
    sys.exit(main())
