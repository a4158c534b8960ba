"""Red team of `jointrl jobs serve` through its HTTP API, written as the attacker would.

Classes, each a test that fails if it comes back:
- no authentication: anyone reaching the port submits, reads and cancels jobs;
- other clients' jobs: a second key reads, streams or cancels the first key's jobs;
- malformed requests (deep nesting, 5,000-digit numbers, non-UTF-8, wrong types, huge bodies and
  queries) answered with a 500 instead of a 4xx;
- start-up: an empty or blank key accepted, or a non-loopback bind without a key;
- (slow, real vLLM engine) the policy server's /generate and /score reachable without its key, or fed
  out-of-range fields (seed = 2^64, token ids past the vocabulary, NaN temperature, ...) that reach
  the engine, after which every later job would fail;
- (slow, real workers) one job that stalls a worker: an attempt past --job-timeout fails and the worker
  is freed, so an honest job submitted behind it still completes.

The API tests serve the real app (rl/jobs/api.py) with uvicorn on a loopback port, over a real SQLite
store and a real redis-server (the conftest's), with no agent workers (max 0): the routes, the key gate
and the parsing are what is under test. The CLI is run as a subprocess against the same server.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rl.jobs.server import free_port

KEY_A = "key-of-client-a-0123456789"
KEY_B = "key-of-client-b-9876543210"
ENV = "terminal-basics-v0"
CLI = [sys.executable, "-m", "rl.cli", "jobs"]


class ApiServer:
    """The jobs API app on a loopback port in a thread (uvicorn), over a real store and broker."""

    def __init__(self, tmp, redis_url: str, keys: tuple[str, ...], limiter=None) -> None:  # noqa: ANN001 - an rl.ratelimit.RateLimiter
        import uvicorn

        from rl.jobs.api import create_app
        from rl.jobs.broker import Broker
        from rl.jobs.pool import Autoscaler, WorkerPool
        from rl.jobs.records import JobsConfig
        from rl.jobs.store import open_store

        stream = f"redteam:{os.getpid()}:{len(keys)}:{time.monotonic_ns()}"
        cfg = JobsConfig(redis_url=redis_url, db_url=f"sqlite:///{tmp}/jobs.sqlite", stream=stream, min_workers=0, max_workers=0, workers=0)
        self.store = open_store(cfg.db_url)
        self.broker = Broker(redis_url, stream)
        pool = WorkerPool(cfg, "http://127.0.0.1:9", str(tmp))
        app = create_app(self.store, self.broker, pool, Autoscaler(cfg, pool, self.broker), api_keys=keys, limiter=limiter)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the API server did not start"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.broker.r.delete(self.broker.stream)
        self.broker.close()
        self.store.close()


@pytest.fixture
def keyed(tmp_path, redis_url):
    srv = ApiServer(tmp_path, redis_url, (KEY_A, KEY_B))
    yield srv
    srv.close()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _submit(url: str, key: str, **kw) -> str:
    r = httpx.post(f"{url}/v1/jobs", json={"env": ENV, **kw}, headers=_auth(key), timeout=300)  # the first imports the env plug-ins
    assert r.status_code == 201, r.text
    return r.json()["id"]


# ----------------------------------------------------------------------------- keys and owners
def test_every_route_needs_a_key(keyed):
    jid = _submit(keyed.url, KEY_A)
    routes = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/jobs/workers"), ("POST", "/v1/jobs"),
              ("GET", f"/v1/jobs/{jid}"), ("GET", f"/v1/jobs/{jid}/events"), ("DELETE", f"/v1/jobs/{jid}"), ("GET", "/nosuch")]
    no_keys = [{}, {"x-api-key": ""}, {"x-api-key": " "}, {"Authorization": "Bearer "}, {"Authorization": "Bearer"},
               {"x-api-key": KEY_A[:-1]}, {"x-api-key": KEY_A + "x"}, {"Authorization": f"Basic {KEY_A}"},
               {"x-api-key": "é".encode().decode("latin-1")}]
    for method, path in routes:
        for headers in no_keys:
            code = _raw(keyed.port, method, path, headers, json.dumps({"env": ENV}).encode())
            assert code == 401, (method, path, headers, code)
    assert keyed.store.get(jid).status == "queued"  # no unauthenticated DELETE got through
    assert keyed.store.counts() == {"queued": 1}  # no unauthenticated POST got through
    for headers in ({"x-api-key": KEY_B}, {"Authorization": f"bearer {KEY_B}"}, {"Authorization": f"Bearer  {KEY_B}"}):
        assert _raw(keyed.port, "GET", "/health", headers) == 200, headers


def test_a_job_belongs_to_the_key_that_submitted_it(keyed):
    a = _submit(keyed.url, KEY_A)
    b = _submit(keyed.url, KEY_B)
    for path in (f"/v1/jobs/{a}", f"/v1/jobs/{a}/events", f"/v1/jobs/{a}/events?after=0"):
        r = httpx.get(f"{keyed.url}{path}", headers=_auth(KEY_B), timeout=30)
        assert r.status_code == 404, (path, r.status_code, r.text)
    r = httpx.delete(f"{keyed.url}/v1/jobs/{a}", headers=_auth(KEY_B), timeout=30)
    assert r.status_code == 404 and keyed.store.get(a).status == "queued"
    # someone else's job and a job that does not exist answer alike: ids cannot be probed
    missing = httpx.get(f"{keyed.url}/v1/jobs/{'0' * 32}", headers=_auth(KEY_B), timeout=30)
    assert missing.status_code == 404 and set(missing.json()) == set(r.json()) == {"detail"}
    # the owner reads, streams and cancels its own job
    assert httpx.get(f"{keyed.url}/v1/jobs/{a}", headers=_auth(KEY_A), timeout=30).json()["status"] == "queued"
    assert "owner" not in httpx.get(f"{keyed.url}/v1/jobs/{a}", headers=_auth(KEY_A), timeout=30).json()
    r = httpx.delete(f"{keyed.url}/v1/jobs/{a}", headers=_auth(KEY_A), timeout=30)
    assert r.json()["status"] == "cancelled"
    with httpx.stream("GET", f"{keyed.url}/v1/jobs/{a}/events", headers=_auth(KEY_A), timeout=30) as s:
        kinds = [json.loads(line[6:])["kind"] for line in s.iter_lines() if line.startswith("data: ")]
    assert kinds == ["queued", "cancelled"]
    assert httpx.get(f"{keyed.url}/v1/jobs/{b}", headers=_auth(KEY_B), timeout=30).json()["status"] == "queued"
    assert keyed.store.get(a).owner != keyed.store.get(b).owner and KEY_A not in str(keyed.store.get(a).owner)


def test_cli_sends_the_key_from_the_flag_or_the_environment(keyed):
    env = {k: v for k, v in os.environ.items() if k != "JOINTRL_JOBS_API_KEY"}
    out = subprocess.run([*CLI, "submit", ENV, "--index", "3", "--url", keyed.url, "--api-key", KEY_A], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    jid = json.loads(out.stdout)["id"]
    out = subprocess.run([*CLI, "status", jid, "--url", keyed.url], capture_output=True, text=True, timeout=120,
                         env={**env, "JOINTRL_JOBS_API_KEY": KEY_A})
    assert out.returncode == 0 and json.loads(out.stdout)["spec"]["index"] == 3
    out = subprocess.run([*CLI, "cancel", jid, "--url", keyed.url, "--api-key", KEY_B], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 1 and "HTTP 404" in out.stderr and keyed.store.get(jid).status == "queued"
    out = subprocess.run([*CLI, "status", jid, "--url", keyed.url], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "HTTP 401" in out.stderr
    out = subprocess.run([*CLI, "status", jid, "--url", keyed.url, "--api-key", " "], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2 and "empty or blank" in out.stderr


def test_serve_refuses_blank_keys_and_an_open_non_loopback_bind_before_starting():
    env = {k: v for k, v in os.environ.items() if k != "JOINTRL_JOBS_API_KEY"}
    cases = [(["--host", "0.0.0.0"], {}, "needs an API key"), (["--api-key", ""], {}, "empty or blank"),
             (["--api-key", "  "], {}, "empty or blank"), (["--api-key", "a b"], {}, "printable ASCII"),
             ([], {"JOINTRL_JOBS_API_KEY": ""}, "empty or blank"), ([], {"JOINTRL_JOBS_API_KEY": f"{KEY_A},"}, "empty or blank"),
             (["--job-timeout", "0"], {}, "jobs.job_timeout_s"), (["--rate-limit-per-s=-inf"], {}, "--rate-limit-per-s"),
             (["--rate-limit-burst", "0"], {}, "--rate-limit-burst")]
    for flags, extra, msg in cases:
        t0 = time.monotonic()
        out = subprocess.run([*CLI, "serve", "tiny", "--port", str(free_port()), *flags], capture_output=True, text=True,
                             timeout=120, env={**env, **extra})
        assert out.returncode == 2 and msg in out.stderr, (flags, extra, out.stderr[-500:])
        assert time.monotonic() - t0 < 60  # refused before any child (redis, policy, workers) starts


def test_without_keys_on_loopback_the_api_is_open(tmp_path, redis_url):
    srv = ApiServer(tmp_path, redis_url, ())
    try:
        jid = httpx.post(f"{srv.url}/v1/jobs", json={"env": ENV}, timeout=30).json()["id"]
        assert httpx.get(f"{srv.url}/v1/jobs/{jid}", timeout=30).status_code == 200 and srv.store.get(jid).owner is None
    finally:
        srv.close()


# ----------------------------------------------------------------------------- malformed requests
def _raw(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> int:
    """One request with exactly these bytes (httpx refuses or re-encodes some of them); the status code."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    req = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{head}"
           f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1") + body
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(req)
        except (BrokenPipeError, ConnectionResetError):  # answered (413) and closed before the body was all sent
            pass
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split(b" ", 2)[1])


HOSTILE_BODIES: list[tuple[str, bytes]] = [
    ("100,000-deep array", b"[" * 100_000 + b"]" * 100_000),
    ("8,000-deep array within the size limit", b"[" * 8000 + b"]" * 8000),
    ("3,000-deep object within the size limit", b'{"a":' * 3000 + b"1" + b"}" * 3000),
    ("100,000-deep object", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    ("deep value in a field", b'{"env": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("5,000-digit index", b'{"env": "terminal-basics-v0", "index": ' + b"9" * 5000 + b"}"),
    ("4,000-digit index (parses)", b'{"env": "terminal-basics-v0", "index": ' + b"9" * 4000 + b"}"),
    ("index 2^63", b'{"env": "terminal-basics-v0", "index": 9223372036854775808}'),
    ("negative index", b'{"env": "terminal-basics-v0", "index": -1}'),
    ("float index", b'{"env": "terminal-basics-v0", "index": 1.5}'),
    ("1e400 index", b'{"env": "terminal-basics-v0", "index": 1e400}'),
    ("NaN index", b'{"env": "terminal-basics-v0", "index": NaN}'),
    ("bool index", b'{"env": "terminal-basics-v0", "index": true}'),
    ("string index", b'{"env": "terminal-basics-v0", "index": "3"}'),
    ("list env", b'{"env": ["terminal-basics-v0"]}'),
    ("dict split", b'{"env": "terminal-basics-v0", "split": {}}'),
    ("list thinking", b'{"env": "terminal-basics-v0", "thinking": ["low"]}'),
    ("unknown field", b'{"env": "terminal-basics-v0", "priority": 9}'),
    ("unknown env", b'{"env": "nosuch-v0"}'),
    ("huge env id", b'{"env": "' + b"a" * 10_000 + b'-v0"}'),
    ("no env", b"{}"),
    ("null", b"null"),
    ("a string", b'"terminal-basics-v0"'),
    ("an array", b'[{"env": "terminal-basics-v0"}]'),
    ("empty", b""),
    ("truncated", b'{"env": "terminal-basics-v0"'),
    ("not UTF-8", b'{"env": "\xff\xfe terminal"}'),
    ("lone surrogate", b'{"env": "\\ud800"}'),
    ("NUL in env", b'{"env": "terminal\\u0000-v0"}'),
    ("past the body limit", b'{"env": "' + b"a" * 100_000 + b'"}'),
]


@pytest.mark.parametrize("name,body", HOSTILE_BODIES, ids=[n for n, _ in HOSTILE_BODIES])
def test_malformed_submissions_get_a_4xx(keyed, name, body):
    code = _raw(keyed.port, "POST", "/v1/jobs", {"x-api-key": KEY_A}, body)
    assert 400 <= code < 500, (name, code)
    assert keyed.store.counts() == {}  # nothing was recorded


def test_malformed_queries_and_headers_get_a_4xx_and_the_server_keeps_serving(keyed):
    jid = _submit(keyed.url, KEY_A)
    h = _auth(KEY_A)
    for after in ("-1", "abc", "1e3", "9" * 30, "9" * 5000, "٣", "1.5", "9223372036854775808"):
        r = httpx.get(f"{keyed.url}/v1/jobs/{jid}/events", params={"after": after}, headers=h, timeout=30)
        assert r.status_code == 422, (after, r.status_code)
    for last in ("٣".encode().decode("latin-1"), "²", "9" * 5000, "99999999999999999999", "-5"):
        code = _raw(keyed.port, "GET", f"/v1/jobs/{jid}/events", {"x-api-key": KEY_A, "Last-Event-ID": last})
        assert code == 422, (last, code)
    for job_id in ("x" * 5000, "%00", "..", "a" * 65):
        r = httpx.get(f"{keyed.url}/v1/jobs/{job_id}", headers=h, timeout=30)
        assert r.status_code == 404, (job_id, r.status_code)
    huge_cl = {"x-api-key": KEY_A, "Content-Length": "9" * 40}
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as s:
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in huge_cl.items()).encode() + b"\r\n")
        status = s.recv(4096).split(b" ", 2)[1]
    assert 400 <= int(status) < 500
    # after every attack: the server answers, and an honest job is accepted and visible
    with httpx.stream("GET", f"{keyed.url}/v1/jobs/{jid}/events?after=1", headers=h, timeout=5) as s:
        assert s.status_code == 200
    assert httpx.get(f"{keyed.url}/health", headers=h, timeout=30).status_code == 200
    ok = _submit(keyed.url, KEY_A, split="heldout", index=2, thinking="max")
    assert httpx.get(f"{keyed.url}/v1/jobs/{ok}", headers=h, timeout=30).json()["spec"] == {
        "env": ENV, "split": "heldout", "index": 2, "thinking": "max"}


# ----------------------------------------------------------------------------- the internal policy server
GOOD = {"prompt_token_ids": [1, 20, 30, 40], "max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "seed": 7}
BAD_FIELDS: list[tuple[str, object]] = [
    ("seed", 2**64), ("seed", 2**63), ("seed", -1), ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("prompt_token_ids", []), ("prompt_token_ids", [1, -1]), ("prompt_token_ids", [1, 10**9]), ("prompt_token_ids", [1, 2**64]),
    ("prompt_token_ids", [1] * 2048), ("prompt_token_ids", "1 2 3"), ("prompt_token_ids", [1, 2.0]), ("prompt_token_ids", [[1]]),
    ("max_tokens", 0), ("max_tokens", 10**12), ("max_tokens", -5), ("max_tokens", None),
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.1), ("temperature", 1e308), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("stop_token_ids", [10**9]), ("stop_token_ids", [-1]), ("stop_token_ids", list(range(1000))),
    ("thinking_budget", -1), ("thinking_budget", 10**9),
    ("routed_experts_prompt_start", 99), ("routed_experts_prompt_start", -1),
    ("ignore_eos", "yes"), ("images", [{"pixels": [1, 2]}]), ("logit_bias", {"5": 100}),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={str(v)[:20]}" for f, v in BAD_FIELDS])
def test_policy_request_fields_are_held_to_the_engine_ranges(field, value):
    from rl.jobs.policy import BadRequest, PolicyLimits, check_request

    limits = PolicyLimits(vocab_size=512, max_model_len=2048)
    assert check_request(dict(GOOD), limits).seed == 7
    with pytest.raises(BadRequest, match=field):
        check_request({**GOOD, field: value}, limits)


@pytest.mark.slow
def test_policy_server_needs_its_key_and_no_request_can_poison_the_engine(policy_url):
    """Through HTTP, against the real engine: every route needs the policy's key; the red team's poisoning
    seed (2^64) and every out-of-range field get a 400 before reaching the engine; afterwards the engine
    still answers, and a seeded request is reproducible."""
    from tests.rl.jobs.conftest import POLICY_KEY

    key = {"x-api-key": POLICY_KEY}
    for path, method in (("/health", "GET"), ("/generate", "POST"), ("/score", "POST")):
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, f"{policy_url}{path}", headers=headers, json=[GOOD], timeout=60)
            assert r.status_code == 401, (path, headers, r.status_code)
    assert httpx.get(f"{policy_url}/health", headers=key, timeout=60).status_code == 200
    for field, value in BAD_FIELDS:
        body = json.dumps([{**GOOD, field: value}], allow_nan=True)
        r = httpx.post(f"{policy_url}/generate", content=body, headers={**key, "content-type": "application/json"}, timeout=120)
        assert r.status_code == 400, (field, value, r.status_code, r.text[:300])
    for body in (b"[" * 50_000 + b"]" * 50_000, b'[{"seed": ' + b"9" * 5000 + b"}]", b"\xff", b"{}", b"[]",
                 json.dumps([GOOD] * 300).encode(), b'[[1, 2], [1, 99999999]]'):
        for path in ("/generate", "/score"):
            r = httpx.post(f"{policy_url}{path}", content=body, headers={**key, "content-type": "application/json"}, timeout=120)
            assert 400 <= r.status_code < 500, (path, body[:40], r.status_code)
    runs = [httpx.post(f"{policy_url}/generate", json=[GOOD], headers=key, timeout=300) for _ in range(2)]
    assert all(r.status_code == 200 for r in runs), [r.text[:300] for r in runs]
    a, b = (r.json()[0] for r in runs)
    assert len(a["token_ids"]) >= 1 and a["token_ids"] == b["token_ids"]  # the engine is healthy, and seeds still work
    s = httpx.post(f"{policy_url}/score", json=[[1, 20, 30, 40]], headers=key, timeout=300)
    assert s.status_code == 200 and len(s.json()[0]) == 3
