"""`jointrl jobs serve`: bring up broker, database, policy and agent workers, then serve the jobs API.

Start-up order, each step bounded and each failure named:
1. the broker: ping `redis_url`; if nothing answers on loopback, start `redis-server` as a child;
2. the database: open (and migrate) `db_url`;
3. repair: every unfinished job whose broker entry is gone (a fresh Redis, or a crash between the
   database write and the enqueue) is enqueued again, so a restart loses no job;
4. the policy: `policy_url` if given (its key from `$JOINTRL_POLICY_API_KEY`), else a
   `python -m rl.jobs.policy MODEL` child on a free loopback port with a fresh random key that only this
   server and its workers hold (passed in their environment);
5. the worker pool at `workers` replicas and the autoscaler thread;
6. uvicorn on HOST:PORT until SIGINT/SIGTERM; then the workers drain and the children stop.

The jobs API is paced per client address (`rate_limit_per_s`, `rate_limit_burst`; rl/jobs/guard.py: RateGate);
the policy server child is not (rl/jobs/policy.py).

API keys (`api_keys`): required when HOST is not loopback (refused before anything starts otherwise);
with keys, every route needs one and each job belongs to the key that submitted it (rl/jobs/api.py).

What this module does not do: anything a job does (rl/jobs/worker.py) or answer HTTP (rl/jobs/api.py).
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from rl.config import ConfigError
from rl.http_io import free_port  # (scripts/bench_jobs.py imports it from here too)
from rl.jobs.broker import Broker, die_with_parent, ensure_redis
from rl.jobs.guard import LOOPBACK_HOSTS, POLICY_KEY_ENV, check_key
from rl.jobs.records import JobsConfig
from rl.jobs.store import JobStore, open_store
from rl.log import get_logger, setup_logging
from rl.ratelimit import RateLimiter

log = get_logger("jobs.server")


def repair(store: JobStore, broker: Broker) -> int:
    """Enqueue every unfinished job that has no entry in the stream; how many were enqueued."""
    n = 0
    for job_id, entry in store.unfinished():
        if entry is None or not broker.has_entry(entry, job_id):
            store.set_entry(job_id, broker.enqueue(job_id))
            n += 1
    return n


def check_access(host: str, api_keys: Sequence[str]) -> None:
    """Refuse a non-loopback bind without keys (ConfigError naming the flags), before anything starts."""
    for k in api_keys:
        check_key(k, "--api-key")
    if host not in LOOPBACK_HOSTS and not api_keys:
        raise ConfigError(f"--host {host}: serving beyond loopback needs an API key (--api-key, or $JOINTRL_JOBS_API_KEY)")


def serve(model: str, port: int, cfg: JobsConfig, host: str = "127.0.0.1", api_keys: Sequence[str] = ()) -> int:
    from rl.http_run import run_until_stopped

    from rl.jobs.api import create_app
    from rl.jobs.policy import wait_healthy
    from rl.jobs.pool import Autoscaler, WorkerPool

    check_access(host, api_keys)
    setup_logging()
    store = open_store(cfg.db_url)  # first: a bad URL is refused before any child starts
    logs = Path(cfg.db_url[len("sqlite:///"):]).parent / "logs"  # child logs (redis, policy, workers) next to the database
    logs.mkdir(parents=True, exist_ok=True)
    redis_proc = policy_proc = broker = pool = autoscaler = None
    try:
        redis_proc = ensure_redis(cfg.redis_url, str(logs / "redis.log"))
        if redis_proc is not None:
            log.info("started redis-server on port %d", redis_proc.port)
        broker = Broker(cfg.redis_url, cfg.stream)
        n = repair(store, broker)
        if n:
            log.info("re-enqueued %d unfinished job(s) whose broker entries were gone", n)
        policy_url = cfg.policy_url
        if policy_url is None:
            policy_key = secrets.token_urlsafe(32)
            pport = free_port()
            policy_proc = subprocess.Popen([sys.executable, "-m", "rl.jobs.policy", model, "--port", str(pport)],
                                           stdout=open(logs / "policy.log", "ab"), stderr=subprocess.STDOUT,
                                           env={**os.environ, POLICY_KEY_ENV: policy_key},
                                           preexec_fn=die_with_parent(signal.SIGTERM))
            policy_url = f"http://127.0.0.1:{pport}"
            log.info("starting the policy server for %s (pid %d)", model, policy_proc.pid)
        else:
            policy_key = check_key(os.environ.get(POLICY_KEY_ENV), f"${POLICY_KEY_ENV} (the key of the policy server at --policy-url)")
        wait_healthy(policy_url, timeout_s=600, proc=policy_proc, api_key=policy_key)
        pool = WorkerPool(cfg, policy_url, str(logs), policy_key=policy_key)
        autoscaler = Autoscaler(cfg, pool, broker)
        pool.scale_to(cfg.initial_workers)
        autoscaler.start()
        app = create_app(store, broker, pool, autoscaler, api_keys=api_keys,
                         limiter=RateLimiter(cfg.rate_limit_per_s, cfg.rate_limit_burst))
        log.info("jobs API on http://%s:%d (%d worker(s), policy %s, API keys: %d, rate limit %g/s per client, burst %d)",
                 host, port, cfg.initial_workers, policy_url, len(api_keys), cfg.rate_limit_per_s, cfg.rate_limit_burst)
        run_until_stopped(app, host, port, log_level="warning")
    finally:
        log.info("shutting down")
        if autoscaler is not None:
            autoscaler.stop()
        if pool is not None:
            pool.stop()  # drains: the jobs in hand finish first
        if policy_proc is not None and policy_proc.poll() is None:
            policy_proc.terminate()
            try:
                policy_proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                policy_proc.kill()
        if broker is not None:
            broker.close()
        store.close()
        if redis_proc is not None:
            redis_proc.stop()
            log.info("redis-server on port %d stopped (exit %s)", redis_proc.port, redis_proc.proc.returncode)
    return 0
