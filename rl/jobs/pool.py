"""Agent-worker replicas as child processes, and the controller that scales them by queue depth.

`WorkerPool` starts `python -m rl.jobs.worker` processes (each dies with the server: PR_SET_PDEATHSIG),
lists them with their pids, and scales down by *draining*: SIGTERM makes a worker finish the job in
hand before it exits, so scale-down never abandons in-flight work. A replica that dies on its own (a
crash, a kill) is reaped and replaced on the next tick; its job is claimed by another worker
(rl/jobs/broker.py).

`Autoscaler.tick()` is the control law, one explicit step that tests can drive: with `q` entries
queued and `f` in flight (delivered, not acknowledged),
    target = clamp(ceil((q + f) / jobs_per_worker), min_workers, max_workers);
scale up at once; scale down only after the target has stayed below the replica count for
`scale_down_delay_s` (no flapping between bursts).

Why an explicit controller over processes rather than Ray Serve autoscaling: Serve scales a
deployment by the requests routed *through Serve*, while agent jobs arrive through a Redis stream
that Serve does not see; its downscale does not wait for a job an actor pulled from a queue itself;
and its controller and proxy cost a Ray cluster's start-up on every `jobs serve`. Queue depth read
from the broker is the signal the workload actually has.

What this module does not do: run jobs, or scale the policy engine (one engine serves all replicas).
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from rl.jobs.broker import Broker, die_with_parent
from rl.jobs.guard import POLICY_KEY_ENV
from rl.jobs.records import JobsConfig, PoolStats, WorkerInfo
from rl.log import get_logger

log = get_logger("jobs.pool")
SCALE_INTERVAL_S = 1.0  # seconds between autoscaler ticks


@dataclass
class _Replica:
    name: str
    proc: subprocess.Popen
    started_at: float
    draining: bool = False


class WorkerPool:
    def __init__(self, cfg: JobsConfig, policy_url: str, log_dir: str, policy_key: str | None = None) -> None:
        self.cfg = cfg
        self.policy_url = policy_url
        self._env = {**os.environ, **({POLICY_KEY_ENV: policy_key} if policy_key is not None else {})}
        self.log_dir = log_dir
        self._replicas: list[_Replica] = []
        self._lock = threading.Lock()
        self._n = 0
        self.spawned = 0
        self.died = 0  # exited without being asked to

    def _spawn(self) -> None:
        self._n += 1
        name = f"w{self._n}-{int(time.time() * 1000) % 10**8}"  # unique across server restarts: a new consumer name
        out = open(f"{self.log_dir}/{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "rl.jobs.worker", "--name", name, "--policy-url", self.policy_url,
                                 "--config", self.cfg.to_json()], stdout=out, stderr=subprocess.STDOUT, env=self._env,
                                preexec_fn=die_with_parent(signal.SIGKILL))
        self._replicas.append(_Replica(name, proc, time.time()))
        self.spawned += 1
        log.info("worker %s started (pid %d)", name, proc.pid)

    def reap(self) -> None:
        with self._lock:
            for r in list(self._replicas):
                if r.proc.poll() is not None:
                    self._replicas.remove(r)
                    if not r.draining:
                        self.died += 1
                        log.warning("worker %s (pid %d) exited with %s", r.name, r.proc.pid, r.proc.returncode)

    def scale_to(self, n: int) -> None:
        """Start workers up to `n` live (non-draining) ones, or drain the newest beyond `n`."""
        self.reap()
        with self._lock:
            live = [r for r in self._replicas if not r.draining]
            for _ in range(n - len(live)):
                self._spawn()
            for r in live[n:][::-1] if len(live) > n else ():
                r.draining = True
                r.proc.send_signal(signal.SIGTERM)
                log.info("worker %s draining", r.name)

    def live(self) -> int:
        with self._lock:
            return sum(1 for r in self._replicas if not r.draining)

    def alive(self) -> int:
        with self._lock:
            return sum(1 for r in self._replicas if r.proc.poll() is None)

    def workers(self) -> list[WorkerInfo]:
        with self._lock:
            return [WorkerInfo(name=r.name, pid=r.proc.pid, state="draining" if r.draining else "running", started_at=r.started_at)
                    for r in self._replicas if r.proc.poll() is None]

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain every worker (bounded wait), then kill what is left."""
        with self._lock:
            for r in self._replicas:
                if r.proc.poll() is None:
                    r.draining = True
                    r.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for r in self._replicas:
                try:
                    r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
            self._replicas.clear()


def target_replicas(queued: int, in_flight: int, cfg: JobsConfig) -> int:
    return max(cfg.min_workers, min(cfg.max_workers, math.ceil((queued + in_flight) / cfg.jobs_per_worker)))


class Autoscaler:
    def __init__(self, cfg: JobsConfig, pool: WorkerPool, broker: Broker) -> None:
        self.cfg = cfg
        self.pool = pool
        self.broker = broker
        self.stats = PoolStats()
        self._below_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: float | None = None) -> PoolStats:
        now = time.monotonic() if now is None else now
        queued, in_flight = self.broker.depth()
        target = target_replicas(queued, in_flight, self.cfg)
        live = self.pool.live()
        if target > live:
            self.pool.scale_to(target)
            self._below_since = None
        elif target < live:
            self._below_since = now if self._below_since is None else self._below_since
            if now - self._below_since >= self.cfg.scale_down_delay_s:
                self.pool.scale_to(target)
                self._below_since = None
        else:
            self._below_since = None
            self.pool.scale_to(target)  # replaces replicas that died
        replicas = self.pool.live()
        s = self.stats
        s.queued, s.in_flight, s.target = queued, in_flight, target
        if not s.history or s.history[-1][1] != replicas:
            s.history.append((time.time(), replicas))
            log.info("replicas %d (queued %d, in flight %d)", replicas, queued, in_flight)
        s.replicas = replicas
        return s

    def start(self) -> None:
        def run() -> None:
            while not self._stop.wait(SCALE_INTERVAL_S):
                try:
                    self.tick()
                except Exception as e:  # noqa: BLE001 - a broker hiccup must not stop scaling for good
                    log.warning("autoscaler tick failed: %r", e)

        self.tick()
        self._thread = threading.Thread(target=run, name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
