"""`jointrl jobs serve`: bring up broker, database, policy and agent workers, then serve the jobs API.

Start-up order, each step bounded and each failure named:
1. the broker: ping `redis_url`; if nothing answers on loopback, start `redis-server` as a child;
2. the database: open (and migrate) `db_url`;
3. repair: every unfinished job whose broker entry is gone (a fresh Redis, or a crash between the
   database write and the enqueue) is enqueued again, so a restart loses no job;
4. the policy: `policy_url` if given, else a `python -m rl.jobs.policy MODEL` child on a free port;
5. the worker pool at `workers` replicas and the autoscaler thread;
6. uvicorn on 127.0.0.1:PORT until SIGINT/SIGTERM; then the workers drain and the children stop.

What this module does not do: anything a job does (rl/jobs/worker.py) or answer HTTP (rl/jobs/api.py).
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from rl.jobs.broker import Broker, die_with_parent, ensure_redis
from rl.jobs.records import JobsConfig
from rl.jobs.store import JobStore, open_store
from rl.log import get_logger, setup_logging

log = get_logger("jobs.server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def repair(store: JobStore, broker: Broker) -> int:
    """Enqueue every unfinished job that has no entry in the stream; how many were enqueued."""
    n = 0
    for job_id, entry in store.unfinished():
        if entry is None or not broker.has_entry(entry, job_id):
            store.set_entry(job_id, broker.enqueue(job_id))
            n += 1
    return n


def serve(model: str, port: int, cfg: JobsConfig, host: str = "127.0.0.1") -> int:
    from rl.http_run import run_until_stopped

    from rl.jobs.api import create_app
    from rl.jobs.policy import wait_healthy
    from rl.jobs.pool import Autoscaler, WorkerPool

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
            pport = free_port()
            policy_proc = subprocess.Popen([sys.executable, "-m", "rl.jobs.policy", model, "--port", str(pport)],
                                           stdout=open(logs / "policy.log", "ab"), stderr=subprocess.STDOUT,
                                           preexec_fn=die_with_parent(signal.SIGTERM))
            policy_url = f"http://127.0.0.1:{pport}"
            log.info("starting the policy server for %s (pid %d)", model, policy_proc.pid)
        wait_healthy(policy_url, timeout_s=600, proc=policy_proc)
        pool = WorkerPool(cfg, policy_url, str(logs))
        autoscaler = Autoscaler(cfg, pool, broker)
        pool.scale_to(cfg.initial_workers)
        autoscaler.start()
        app = create_app(store, broker, pool, autoscaler)
        log.info("jobs API on http://%s:%d (%d worker(s), policy %s)", host, port, cfg.initial_workers, policy_url)
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
