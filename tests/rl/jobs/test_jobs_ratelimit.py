"""The per-client rate limit of `jointrl jobs serve`, through the real command and real HTTP.

A flood from one client address is answered 429 with `Retry-After` before the key check and before the
body is read (a wrong key gets 429, not 401; a body that would take parsing or never arrives gets 429
at once); requests within the limit are answered as before; other addresses keep their own bucket;
`rate_limit_per_s` 0 lets a burst through (the app as the server builds it, served in this process,
as tests/rl/jobs/test_jobs_redteam.py serves it); bad values of either flag are refused before anything
starts. The internal policy server has no limit: a burst past the API's default is all answered.

The jobs server is the real `python -m rl.cli jobs serve` over the conftest's real redis-server and a
SQLite file, API only (`--workers 0`, no agent worker), given `--policy-url` of a stand-in: the real
policy app (rl/jobs/policy.py: build_app, its key gate included) over an engine stub that only answers
/health, since nothing here generates and a vLLM engine would cost a minute to start.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from rl.jobs.server import free_port

KEY = "key-of-the-ratelimit-test-0123"
POLICY_KEY = "policy-key-of-the-ratelimit-test"
ENV = "terminal-basics-v0"
OTHER = "127.0.0.3"  # another client address (all of 127/8 is loopback on Linux): its own bucket


@pytest.fixture(scope="module")
def stand_in_policy():
    """The real policy app on loopback over an engine stub (health only); its URL."""
    import uvicorn

    from rl.jobs.policy import PolicyLimits, build_app

    engine = SimpleNamespace(config=SimpleNamespace(model_path="stand-in"), policy_version=0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, PolicyLimits(vocab_size=512, max_model_len=2048), POLICY_KEY),
                                           host="127.0.0.1", port=port, log_level="warning", access_log=False))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and th.is_alive(), "the stand-in policy server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    th.join(timeout=10)


class Served:
    """`jointrl jobs serve` as a subprocess; `client(address)` sends from that loopback address."""

    def __init__(self, tmp: Path, redis_url: str, policy_url: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "jobs.log"
        env = {**os.environ, "JOINTRL_POLICY_API_KEY": POLICY_KEY}
        env.pop("JOINTRL_JOBS_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rl.cli", "jobs", "serve", "stand-in", "--port", str(self.port), "--db",
             f"sqlite:///{tmp}/jobs.sqlite", "--redis-url", redis_url, "--policy-url", policy_url, "--workers", "0",
             "--api-key", KEY, *flags], stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        with self.client(OTHER) as c:  # polled from OTHER: the buckets of the addresses under test stay full
            while True:
                assert self.proc.poll() is None, f"jobs server exited: {self.log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "jobs server did not come up"
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)

    def client(self, address: str = "127.0.0.1") -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=300, headers={"x-api-key": KEY},
                            transport=httpx.HTTPTransport(local_address=address))

    def raw(self, head: bytes) -> tuple[int, dict[str, str], bytes]:
        """A request of exactly these bytes from 127.0.0.1, the answer read within 10 s: (status, headers, body)."""
        data = b""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(head)
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        return int(lines[0].split(" ", 2)[1]), headers, rest

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


@pytest.fixture
def clean_stream(redis_url):
    """The default stream `jobs serve` enqueues into, emptied after the test (the e2e tests empty it before theirs)."""
    yield
    import redis

    redis.Redis.from_url(redis_url).delete("jointrl:jobs")


def _is_rate_limited(status: int, headers: dict[str, str] | httpx.Headers, body: bytes, per_s: float) -> bool:
    if status != 429:
        return False
    wait = int(headers["retry-after"])  # whole seconds, at least 1, at most the time one token takes
    assert 1 <= wait <= int(1 / per_s + 0.999), headers
    assert "too many requests" in json.loads(body)["detail"]
    return True


def test_a_flood_gets_429_before_the_key_check_and_the_body_and_within_the_limit_nothing_changes(
        tmp_path, redis_url, stand_in_policy, clean_stream):
    per_s, burst = 0.1, 5  # one token per 10 s: no refill can land within the test's few seconds
    srv = Served(tmp_path, redis_url, stand_in_policy, "--rate-limit-per-s", str(per_s), "--rate-limit-burst", str(burst))
    try:
        with srv.client(OTHER) as other:  # the first submission imports the environment plug-ins (seconds): done from OTHER
            warm = other.post("/v1/jobs", json={"env": ENV})
            assert warm.status_code == 201, warm.text
        # within the limit: the burst's five requests are answered as without a limit
        with srv.client() as c:
            t0 = time.monotonic()
            r = c.post("/v1/jobs", json={"env": ENV, "index": 3})
            assert r.status_code == 201, r.text
            jid = r.json()["id"]
            assert c.get(f"/v1/jobs/{jid}").json()["spec"]["index"] == 3
            assert c.get("/v1/jobs/workers").json() == {"workers": []}
            assert c.get("/metrics").status_code == 200
            assert c.delete(f"/v1/jobs/{jid}").json()["status"] == "cancelled"
            # past it: 429 whatever the request, the right key or none
            r = c.get(f"/v1/jobs/{jid}")
            assert _is_rate_limited(r.status_code, r.headers, r.content, per_s), (r.status_code, r.text)
        for headers in ({"x-api-key": "wrong-key"}, {}, {"Authorization": "Bearer " + KEY[:-1]}):
            with httpx.Client(base_url=srv.url, timeout=30) as anon:
                r = anon.post("/v1/jobs", json={"env": ENV}, headers=headers)
                assert _is_rate_limited(r.status_code, r.headers, r.content, per_s), (headers, r.status_code)  # not 401
        deep = b"[" * 100_000 + b"]" * 100_000  # 400 once parsed
        huge = b'{"env": "' + b"a" * 100_000 + b'"}'  # 413 once its length is seen
        with srv.client() as c:
            for body in (deep, huge):
                r = c.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
                assert _is_rate_limited(r.status_code, r.headers, r.content, per_s), (body[:12], r.status_code)
        # a body announced and never sent: answered at once, so the gate did not wait to read it
        head = (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
                f"Content-Length: 1000000\r\n\r\n").encode()
        assert _is_rate_limited(*srv.raw(head), per_s)
        assert time.monotonic() - t0 < 1 / per_s  # else a refilled token could have let one through
        # another address has its own bucket; the flood recorded nothing and cancelled nothing
        with srv.client(OTHER) as other:
            assert other.get("/health").json()["counts"] == {"queued": 1, "cancelled": 1}
            assert other.get(f"/v1/jobs/{warm.json()['id']}").json()["status"] == "queued"
            r = other.get("/health", headers={"x-api-key": "wrong-key"})
            assert r.status_code == 401  # within its limit the key check answers as before
    finally:
        srv.close()


@pytest.mark.parametrize("per_s,expect", [(0.0, [401, 200] * 30), (0.1, [401] + [429] * 59)], ids=["off", "on"])
def test_rate_limit_zero_lets_a_burst_through(tmp_path, redis_url, per_s, expect):
    """The app as `jobs serve` builds it (its limiter from JobsConfig), served in this process: with
    `rate_limit_per_s` 0 a burst passes that burst 1 would refuse from its second request."""
    from rl.jobs.records import JobsConfig
    from rl.ratelimit import RateLimiter
    from tests.rl.jobs.test_jobs_redteam import ApiServer

    cfg = JobsConfig(rate_limit_per_s=per_s, rate_limit_burst=1)
    srv = ApiServer(tmp_path, redis_url, (KEY,), limiter=RateLimiter(cfg.rate_limit_per_s, cfg.rate_limit_burst))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            codes = [c.get("/health", headers={"x-api-key": KEY if i % 2 else "wrong-key"}).status_code for i in range(60)]
        assert codes == expect
    finally:
        srv.close()


def test_the_policy_server_is_not_rate_limited(stand_in_policy):
    """The workers all share one loopback address and fail their job on any error status: a burst past the
    jobs API's default bucket (512) is all answered."""
    from rl.jobs.records import JobsConfig

    n = JobsConfig().rate_limit_burst + 100
    with httpx.Client(base_url=stand_in_policy, timeout=30, headers={"x-api-key": POLICY_KEY}) as c:
        codes = {c.get("/health").status_code for _ in range(n)}
    assert codes == {200}


BAD_FLAGS = [("--rate-limit-per-s", v, "a finite number >= 0 (0: no limit)") for v in ("-1", "nan", "inf", "-inf", "abc", "", "1e400", "0x10")] + \
            [("--rate-limit-burst", v, "an integer >= 1") for v in ("0", "-3", "1.5", "abc", "", "1e3")]


@pytest.mark.parametrize("flag,value,allowed", BAD_FLAGS, ids=[f"{f}={v}" for f, v, _ in BAD_FLAGS])
def test_bad_values_are_refused_naming_the_flag_before_anything_starts(flag, value, allowed, capsys, tmp_path):
    from rl.jobs.cli import main

    db = tmp_path / "never.sqlite"
    assert main(["serve", "tiny", "--db", f"sqlite:///{db}", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert flag in err and allowed in err, err
    assert not db.exists()  # refused before the database (the first thing serve opens)


def test_the_flags_reach_the_config_workers_read():
    from rl.config import ConfigError
    from rl.jobs.cli import build_parser, config_from_args
    from rl.jobs.records import JobsConfig

    cfg = config_from_args(build_parser().parse_args(["serve", "tiny", "--rate-limit-per-s", "2.5", "--rate-limit-burst", "7"]))
    assert (cfg.rate_limit_per_s, cfg.rate_limit_burst) == (2.5, 7)
    assert config_from_args(build_parser().parse_args(["serve", "tiny", "--rate-limit-per-s", "0"])).rate_limit_per_s == 0
    assert JobsConfig.from_json(cfg.to_json()) == cfg
    d = config_from_args(build_parser().parse_args(["serve", "tiny"]))
    assert (d.rate_limit_per_s, d.rate_limit_burst) == (JobsConfig.rate_limit_per_s, JobsConfig.rate_limit_burst)
    for bad in ({"rate_limit_per_s": True}, {"rate_limit_per_s": "100"}, {"rate_limit_burst": 2.0}, {"rate_limit_burst": False}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            JobsConfig(**bad)
