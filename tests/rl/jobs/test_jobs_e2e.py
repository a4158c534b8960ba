"""`jointrl jobs serve` end to end: real HTTP, real redis-server, SQLite, agent-worker processes, a real vLLM policy.

- 50 short terminal-basics-v0 jobs, burst from 1 replica to the maximum and back, one worker killed mid-job:
  every job completes exactly once and the database holds every event of every attempt.
- The jobs server killed (SIGKILL) while jobs run, then restarted: no job is lost, clients keep polling;
  a job past its split's end lands in the dead-letter stream on its first attempt; a cancelled job never
  runs to done.
- A job stuck in code that cannot be cancelled (the first generation of a slow environment's task set)
  holds its worker only until --job-timeout: the job fails, the worker is replaced, and an honest job
  submitted behind it completes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from rl.jobs.server import free_port
from rl.jobs.store import open_store

pytestmark = pytest.mark.slow

ENV = "terminal-basics-v0"


class JobsServer:
    def __init__(self, model: Path, db: str, redis_url: str, policy_url: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "rl.cli", "jobs", "serve", str(model), "--port", str(self.port), "--db", db,
                     "--redis-url", redis_url, "--policy-url", policy_url, "--max-turns", "2", "--max-new-tokens", "16",
                     "--claim-timeout", "3", *extra]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> "JobsServer":
        self.proc = subprocess.Popen(self.args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"jobs server exited: {self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError("jobs server did not come up")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _redis_servers_on(port: int) -> list[int]:
    """Pids of live redis-servers on `port`, read from /proc. redis rewrites its command line into the
    title "redis-server 127.0.0.1:<port>"; a zombie's command line is empty."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text().strip()
            title = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
        except OSError:  # the process ended while we looked
            continue
        if comm == "redis-server" and (f"127.0.0.1:{port}" in title or f"*:{port}" in title):
            pids.append(int(d.name))
    return pids


def _submit(url: str, **kw) -> str:
    r = httpx.post(f"{url}/v1/jobs", json={"env": ENV, "split": "train", "thinking": "low", **kw}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def _check_exactly_once(store, ids: list[str]) -> None:
    """Each job: done, one `done` event, one episode, and the completing attempt's full event sequence."""
    eps = {e.group_id[len("job:"):]: e for e in store.episodes(ids)}
    assert sorted(eps) == sorted(ids)
    for jid in ids:
        v = store.get(jid)
        assert v.status == "done", (jid, v.status, v.error)
        evs = store.events(jid)
        assert [e.kind for e in evs].count("done") == 1
        last = evs[-1].attempt
        kinds = [e.kind for e in evs if e.attempt == last]
        turns = v.result.turns
        assert kinds == ["started", *(["claimed"] if "claimed" in kinds else []), "reset", *["turn"] * turns, "graded", "done"], kinds
        ep = eps[jid]
        assert 1 <= ep.num_turns == turns <= 2  # --max-turns 2
        assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.rollout_logprobs) == v.result.num_tokens
        runs, n = [], 0  # generated tokens per turn: runs of loss_mask == 1
        for m in ep.loss_mask:
            if m:
                n += 1
            elif n:
                runs.append(n)
                n = 0
        runs += [n] if n else []
        assert runs and max(runs) <= 16 and len(runs) == turns  # --max-new-tokens 16
        assert all(lp < 0 or m == 0 for lp, m in zip(ep.rollout_logprobs, ep.loss_mask))


def test_fifty_jobs_burst_scaling_and_a_killed_worker(tiny_ckpt, policy_url, tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/jobs.sqlite"
    redis_port = free_port()  # nothing runs there: the server starts its own redis-server
    srv = JobsServer(tiny_ckpt, db, f"redis://127.0.0.1:{redis_port}/0", policy_url, tmp_path / "server.log",
                     "--workers", "1", "--min-workers", "1", "--max-workers", "3", "--jobs-per-worker", "4",
                     "--scale-down-delay", "2").start()
    history: list[tuple[float, int, int]] = []
    try:
        t0 = time.monotonic()
        history.append((0.0, int(_metric(srv.url, "jointrl_jobs_replicas")), 0))
        ids = [_submit(srv.url, index=i) for i in range(50)]
        killed: tuple[str, str] | None = None
        store = open_store(db)
        while time.monotonic() - t0 < 420:
            replicas, queued = int(_metric(srv.url, "jointrl_jobs_replicas")), int(_metric(srv.url, "jointrl_jobs_queue_depth"))
            if not history or history[-1][1:] != (replicas, queued):
                history.append((round(time.monotonic() - t0, 1), replicas, queued))
            if killed is None:
                for jid in ids:
                    evs = store.events(jid)
                    if evs[-1].kind == "reset":  # mid-episode: two generations and the grading are still ahead
                        name = [e for e in evs if e.kind == "started"][-1].data["worker"]
                        pids = {w["name"]: w["pid"] for w in httpx.get(f"{srv.url}/v1/jobs/workers").json()["workers"]}
                        if name in pids:
                            os.kill(pids[name], signal.SIGKILL)
                            killed = (jid, name)
                            assert store.get(jid).status == "running"  # the kill caught the job mid-episode
                        break
            counts = httpx.get(f"{srv.url}/health").json()["counts"]
            if counts.get("done", 0) == 50 and replicas == 1:
                break
            time.sleep(0.5)
        history.append((round(time.monotonic() - t0, 1), int(_metric(srv.url, "jointrl_jobs_replicas")), 0))
        with capsys.disabled():
            print("\nreplicas over time (s, replicas, queued):", history)
        assert killed is not None, "no job was caught mid-episode"
        _check_exactly_once(store, ids)
        v = store.get(killed[0])
        kinds = [e.kind for e in store.events(killed[0])]
        assert v.attempts == 2 and "claimed" in kinds and v.result.worker != killed[1]
        # the killed attempt's events up to the kill are kept, and it never completed
        first = [e.kind for e in store.events(killed[0]) if e.attempt == 1]
        assert first[:2] == ["started", "reset"] and "done" not in first and "graded" not in first
        # only the killed worker's job ran twice: scale-down drained the other replicas' jobs before they exited
        assert sorted(store.get(j).attempts for j in ids) == [1] * 49 + [2]
        reps = [h[1] for h in history]
        assert reps[0] == 1 and max(reps) == 3 and reps[-1] == 1
        assert _metric(srv.url, "jointrl_jobs_latency_seconds_count") == 50
        # the SSE stream replays exactly the stored events
        with httpx.stream("GET", f"{srv.url}/v1/jobs/{ids[0]}/events", timeout=30) as r:
            seqs = [json.loads(line[6:])["seq"] for line in r.iter_lines() if line.startswith("data: ")]
        assert seqs == [e.seq for e in store.events(ids[0])]
        with httpx.stream("GET", f"{srv.url}/v1/jobs/{ids[0]}/events", headers={"Last-Event-ID": str(seqs[2])}, timeout=30) as r:
            assert [json.loads(line[6:])["seq"] for line in r.iter_lines() if line.startswith("data: ")] == seqs[3:]
        store.close()
    finally:
        srv.stop()
    # SIGTERM ran the server's clean-up (uvicorn re-raises the signal, and rl/http_run.py keeps that from
    # killing the process first), which stopped the server's own redis-server: no process is left whose
    # command line is a redis-server on that port. Probing the port itself cannot tell: it lies in the
    # ephemeral range, so once free any outgoing connection may take it as its local port (a bind then
    # fails), or a connect may meet itself there (a ping then reads its own PING back).
    assert srv.proc.returncode == 0, srv.log.read_text()[-1500:]
    assert f"redis-server on port {redis_port} stopped" in srv.log.read_text()
    assert _redis_servers_on(redis_port) == []


def test_server_restart_loses_nothing_poison_is_dead_lettered_cancel_works(tiny_ckpt, policy_url, redis_url, tmp_path):
    db = f"sqlite:///{tmp_path}/jobs.sqlite"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.delete("jointrl:jobs", "jointrl:jobs:dead")
    # An API-only server (no workers) takes the jobs: the cancel below cannot race a worker, and the
    # queued jobs must survive that server's clean stop.
    api_only = JobsServer(tiny_ckpt, db, redis_url, policy_url, tmp_path / "api.log", "--workers", "0", "--max-attempts", "2")
    api_only.start()
    try:
        assert httpx.get(f"{api_only.url}/v1/jobs/workers", timeout=10).json() == {"workers": []}
        ids = [_submit(api_only.url, index=i) for i in range(12)]
        poison = _submit(api_only.url, split="heldout", index=10**6)  # no such task: fails for good at once
        bad = httpx.post(f"{api_only.url}/v1/jobs", json={"env": "nosuch-v0"}, timeout=10)
        assert bad.status_code == 422 and "nosuch-v0" in bad.text
        cli = [sys.executable, "-m", "rl.cli", "jobs"]
        out = subprocess.run([*cli, "submit", ENV, "--index", "40", "--url", api_only.url], capture_output=True, text=True, timeout=60)
        victim = json.loads(out.stdout)["id"]
        out = subprocess.run([*cli, "cancel", victim, "--url", api_only.url], capture_output=True, text=True, timeout=60)
        assert json.loads(out.stdout)["status"] == "cancelled"
        assert {httpx.get(f"{api_only.url}/v1/jobs/{j}", timeout=10).json()["status"] for j in ids} == {"queued"}
    finally:
        api_only.stop()
    srv = JobsServer(tiny_ckpt, db, redis_url, policy_url, tmp_path / "server.log", "--workers", "2", "--max-attempts", "2")
    srv.start()
    try:
        store = open_store(db)
        deadline = time.monotonic() + 240
        while store.counts().get("done", 0) < 2 or store.counts().get("running", 0) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        srv.stop(signal.SIGKILL)  # the server and (PR_SET_PDEATHSIG) its workers die mid-job
        down_polls = 0
        try:
            httpx.get(f"{srv.url}/v1/jobs/{ids[-1]}", timeout=2)
        except httpx.HTTPError:
            down_polls += 1
        assert down_polls == 1
        srv.start()  # same port, database and broker
        deadline = time.monotonic() + 300
        while True:  # the client keeps polling the same URL
            views = [httpx.get(f"{srv.url}/v1/jobs/{j}", timeout=10).json() for j in [*ids, poison]]
            if all(v["status"] in ("done", "failed") for v in views):
                break
            assert time.monotonic() < deadline, [v["status"] for v in views]
            time.sleep(1)
        _check_exactly_once(store, ids)
        assert any(store.get(j).attempts == 2 for j in ids)  # a job interrupted by the kill was taken up again
        p = store.get(poison)
        assert (p.status, p.attempts) == ("failed", 1) and "TaskIndexError" in p.error
        (dl,) = [d for _i, d in r.xrange("jointrl:jobs:dead")]
        assert dl["job_id"] == poison and dl["attempts"] == "1" and "out of range" in dl["error"]
        v = store.get(victim)
        assert v.status == "cancelled" and v.result is None and "done" not in [e.kind for e in store.events(victim)]
        out = subprocess.run([*cli, "watch", ids[0], "--url", srv.url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["kind"] == "done"
        store.close()
    finally:
        srv.stop()


def test_a_stuck_job_holds_its_worker_only_until_the_time_limit(tiny_ckpt, policy_url, tmp_path):
    """The red team's case: a job naming a task past the end of a slow environment's split held the only worker
    for the whole generation (102 s there; cad-v0's first generation took 384 s here at load 20), and an honest
    job queued behind it waited as long. With a cold task cache (a fresh $JOINTRL_CACHE) the same job is
    stuck in synchronous generation that cancellation cannot reach: at --job-timeout it fails, the worker
    process is replaced, and the honest job completes."""
    db = f"sqlite:///{tmp_path}/jobs.sqlite"
    limit = 10.0  # a cold cad-v0 split takes ~20 s to generate even on an idle CI machine
    os.environ["JOINTRL_CACHE"], old = str(tmp_path / "cache"), os.environ.get("JOINTRL_CACHE")
    try:
        srv = JobsServer(tiny_ckpt, db, f"redis://127.0.0.1:{free_port()}/0", policy_url, tmp_path / "server.log",
                         "--workers", "1", "--job-timeout", str(limit)).start()
    finally:
        if old is None:
            os.environ.pop("JOINTRL_CACHE")
        else:
            os.environ["JOINTRL_CACHE"] = old
    try:
        first_worker = httpx.get(f"{srv.url}/v1/jobs/workers", timeout=10).json()["workers"][0]["name"]
        t0 = time.monotonic()
        hostile = httpx.post(f"{srv.url}/v1/jobs", json={"env": "cad-v0", "index": 10**6}, timeout=120).json()["id"]
        honest = _submit(srv.url, index=0)
        store = open_store(db)
        deadline = time.monotonic() + limit + 240
        while store.get(honest).status != "done":
            assert time.monotonic() < deadline, (store.get(hostile), store.get(honest))
            time.sleep(0.5)
        honest_s = time.monotonic() - t0
        h = store.get(hostile)
        print(f"stuck job: {h.status} after {h.finished_at - h.started_at:.1f}s ({h.error}); honest job done "
              f"{honest_s:.1f}s after both were submitted")
        assert h.status == "failed" and "JobTimeout" in h.error and "replaced" in h.error
        assert h.finished_at - h.started_at < limit + 15
        kinds = [e.kind for e in store.events(hostile)]
        assert kinds[-2:] == ["dead_letter", "failed"] and kinds.count("started") == 1  # not retried
        workers = [w["name"] for w in httpx.get(f"{srv.url}/v1/jobs/workers", timeout=10).json()["workers"]]
        assert workers and first_worker not in workers  # the stuck process was replaced
        store.close()
    finally:
        srv.stop()
