"""The jobs broker: a Redis stream read by one consumer group, with claims of stale entries and a dead-letter stream.

Delivery is at least once. A worker reads an entry (`XREADGROUP ... >`), works on the job, and
acknowledges it (`XACK` + `XDEL`) only after the result is in the database. While it works, it
re-claims its own entry every few seconds (`XCLAIM ... JUSTID`, which resets the entry's idle time
without counting a delivery) as a heartbeat. A worker that dies stops the heartbeat; once its entry
has been idle for `claim_timeout_s`, any other worker takes it over with `XAUTOCLAIM`. Because an
entry can thus be worked on twice, the database's completion is idempotent (rl/jobs/store.py).

A job whose attempts keep failing is moved to the dead-letter stream (`<stream>:dead`, fields
`job_id`, `attempts`, `error`) and acknowledged on the main stream.

`ensure_redis(url)` starts a `redis-server` subprocess when nothing answers at a loopback URL
(Debian's package, installed by scripts/setup.sh); the caller owns and stops it.

What this module does not do: know what a job is (entries carry only a job id) or touch the database.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import redis

from rl.config import ConfigError

GROUP = "workers"


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to a worker."""

    entry_id: str
    job_id: str
    claimed: bool  # taken over from another (dead or stalled) consumer


class Broker:
    def __init__(self, url: str, stream: str) -> None:
        self.url = url
        self.stream = stream
        self.dead_stream = f"{stream}:dead"
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=30, socket_connect_timeout=5)
        self.ensure_group()

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # -- producer side
    def enqueue(self, job_id: str) -> str:
        return str(self.r.xadd(self.stream, {"job_id": job_id}))

    def has_entry(self, entry_id: str, job_id: str) -> bool:
        """Whether entry `entry_id` is in the stream and carries `job_id` (a Redis that restarted empty can hand
        out the same id again, for another job)."""
        got = self.r.xrange(self.stream, min=entry_id, max=entry_id, count=1)
        return bool(got) and got[0][1].get("job_id") == job_id

    # -- consumer side
    def read(self, consumer: str, block_ms: int) -> Delivery | None:
        """One new entry for `consumer`, waiting up to `block_ms`; None when nothing came."""
        try:
            got = self.r.xreadgroup(GROUP, consumer, {self.stream: ">"}, count=1, block=block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_group()  # the Redis server restarted empty
            return None
        for _stream, entries in got or ():
            for entry_id, fields in entries:
                if fields is None:  # deleted while pending
                    self.r.xack(self.stream, GROUP, entry_id)
                    continue
                return Delivery(entry_id=entry_id, job_id=fields["job_id"], claimed=False)
        return None

    def claim_stale(self, consumer: str, min_idle_s: float) -> Delivery | None:
        """Take over one entry another consumer has left idle for at least `min_idle_s` (XAUTOCLAIM)."""
        try:
            _next, entries, deleted = self.r.xautoclaim(self.stream, GROUP, consumer, min_idle_time=int(min_idle_s * 1000),
                                                        start_id="0-0", count=1)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_group()
            return None
        for entry_id, fields in entries:
            if fields:
                return Delivery(entry_id=entry_id, job_id=fields["job_id"], claimed=True)
        return None

    def heartbeat(self, consumer: str, entry_id: str) -> bool:
        """Reset the idle time of our own entry; False if another consumer has taken it over."""
        owned = self.r.xpending_range(self.stream, GROUP, min=entry_id, max=entry_id, count=1)
        if not owned or owned[0]["consumer"] != consumer:
            return False
        self.r.xclaim(self.stream, GROUP, consumer, min_idle_time=0, message_ids=[entry_id], justid=True)
        return True

    def ack(self, entry_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.stream, GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        pipe.execute()

    def dead_letter(self, entry_id: str, job_id: str, attempts: int, error: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.dead_stream, {"job_id": job_id, "attempts": str(attempts), "error": error[:2000]})
        pipe.xack(self.stream, GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        pipe.execute()

    def dead_letters(self) -> list[dict[str, str]]:
        return [dict(fields) for _id, fields in self.r.xrange(self.dead_stream)]

    def remove_consumer(self, consumer: str) -> int:
        """Forget a consumer that has stopped: 1 if removed, 0 if unknown, -1 (refused) while it owns pending entries."""
        for c in self.r.xinfo_consumers(self.stream, GROUP):
            if c["name"] == consumer:
                if int(c["pending"]) > 0:
                    return -1
                self.r.xgroup_delconsumer(self.stream, GROUP, consumer)
                return 1
        return 0

    # -- autoscaler inputs
    def depth(self) -> tuple[int, int]:
        """(entries never delivered, entries delivered and not acknowledged)."""
        try:
            groups = self.r.xinfo_groups(self.stream)
        except redis.ResponseError:
            return 0, 0
        for g in groups:
            if g["name"] == GROUP:
                # `lag` (Redis >= 7) counts entries not yet read by the group; acked entries are deleted, so
                # the stream length minus the pending ones is the same number and works when lag is unknown
                pending = int(g["pending"])
                lag = g.get("lag")
                return (int(lag) if lag is not None else max(0, int(self.r.xlen(self.stream)) - pending)), pending
        return 0, 0

    def close(self) -> None:
        self.r.close()


# ----------------------------------------------------------------------------- redis-server
class RedisProcess:
    """A `redis-server` child process on a loopback port (no persistence: the jobs database is the record)."""

    def __init__(self, port: int, log_path: str | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ConfigError("jobs.redis_url: nothing answers there and `redis-server` is not installed "
                              "(bash scripts/setup.sh installs Debian's redis-server)")
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.port = port
        self.proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--daemonize", "no", "--protected-mode", "yes"], stdout=out, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent(signal.SIGTERM))
        r = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {port} did not start (exit {self.proc.returncode})")
                time.sleep(0.05)
        r.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def die_with_parent(sig: int):
    """A preexec_fn: the child gets `sig` when the process that started it dies (Linux PR_SET_PDEATHSIG), and
    its own process group, so a Ctrl-C aimed at the server reaches the children only through the server."""

    def pre() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass
        os.setpgid(0, 0)

    return pre


def ensure_redis(url: str, log_path: str | None = None) -> RedisProcess | None:
    """Ping `url`; if nothing answers on a loopback host, start redis-server there. The process, or None if one was running."""
    r = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        r.ping()
        return None
    except redis.ConnectionError:
        pass
    finally:
        r.close()
    u = urlparse(url)
    if u.hostname not in ("127.0.0.1", "localhost"):
        raise ConfigError(f"jobs.redis_url {url!r}: nothing answers there, and a server is started only on 127.0.0.1")
    return RedisProcess(u.port or 6379, log_path)
