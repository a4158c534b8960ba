"""The served policy the agent workers generate with: one `RolloutEngine` behind a token-level HTTP endpoint.

`python -m rl.jobs.policy MODEL --port P` serves `POST /generate` (a list of `GenerateRequest`s in, a
list of `GenerateResult`s out, token ids and logprobs, no chat templates), `POST /score` (the engine's
logprobs of given sequences) and `GET /health`. Concurrent requests from many workers join the
engine's continuous batching. `RemotePolicy(url).generate_batch` is the client side, the callable the
agent loop's `BatchingGenerator` takes, so an agent job runs the same `run_episode` as training does.

Token-level on purpose: the episode a job records is exactly the tokens the engine sampled, with
their logprobs, so done jobs can feed training (the OpenAI endpoint of rl/serve.py re-renders text).

Only the jobs service may reach it: it binds loopback only, and every route needs its key
(`$JOINTRL_POLICY_API_KEY`; `jointrl jobs serve` makes a fresh one per start and hands it to the
policy and worker processes in their environment, never on a command line). Every request field is
checked against the engine's ranges before the engine sees it (`check_request`: token ids in the
vocabulary, lengths within the context, a seed in [0, 2^63), finite sampling parameters, no images),
so no request can break the engine for the requests after it; a bad one is a 400 naming the field.

No rate limit here, unlike the jobs API in front (rl/jobs/guard.py: RateGate), on purpose: its only
clients are the jobs service's own agent workers, which all share one loopback address (one bucket),
send one `/generate` per episode turn each, and treat any error status as a failed attempt
(`RemotePolicy.generate_batch` raises), so a per-address limit would turn load from honest jobs into
failed and dead-lettered ones. What reaches it is bounded upstream instead: the jobs API's rate limit
on submissions, the worker count (`--max-workers`) and each job's turns and time limit, and the engine's
own continuous batching queues the rest.

What this module does not do: decide which engine settings a run uses beyond max_model_len (defaults
of `EngineConfig`), or serve anything but loopback clients.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx
from starlette.requests import Request  # module level: FastAPI resolves the handlers' (string) annotations here

from rl.config import ConfigError
from rl.jobs.guard import POLICY_KEY_ENV, BodyError, KeyGate, check_key, read_json, short
from rl.rollout.engine import GenerateRequest, GenerateResult

MAX_REQUESTS = 256  # per /generate or /score call (the agent workers send one per episode turn)
MAX_STOP_IDS = 64
MAX_TEMPERATURE = 100.0
SEED_MAX = 2**63 - 1  # the engine's seeded generators take [0, 2^64); an int64 keeps every backend safe
MAX_BODY_BYTES = 16 * 1024 * 1024  # 256 prompts of 2,048 ids


@dataclass(frozen=True)
class PolicyLimits:
    """The ranges a request must fit: the engine's vocabulary and context."""

    vocab_size: int
    max_model_len: int


class BadRequest(ValueError):
    """A request field outside the engine's ranges (a 400 naming the field)."""


def request_to_json(r: GenerateRequest) -> dict[str, Any]:
    d = asdict(r)
    d["prompt_token_ids"] = list(r.prompt_token_ids)
    d["stop_token_ids"] = list(r.stop_token_ids)
    d.pop("images")  # jobs are text-only; the server refuses images
    return d


def _int(d: dict[str, Any], key: str, lo: int, hi: int, default: Any = ...) -> Any:
    v = d.get(key, default)
    if v is ...:
        raise BadRequest(f"{key} is required")
    if v is None and default is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be an integer in [{lo}, {hi}], got {short(v)}")
    return v


def _float(d: dict[str, Any], key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise BadRequest(f"{key} must be a finite number in {'(' if lo_open else '['}{lo}, {hi}], got {short(v)}")
    return float(v)


def _ids(d: dict[str, Any], key: str, limits: PolicyLimits, lo_len: int, hi_len: int) -> tuple[int, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or not lo_len <= len(v) <= hi_len:
        raise BadRequest(f"{key} must be a list of {lo_len} to {hi_len} token ids, got {short(v)}")
    top = limits.vocab_size - 1
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= top:
            raise BadRequest(f"{key}: every token id must be an integer in [0, {top}], got {short(t)}")
    return tuple(v)


_FIELDS = ("prompt_token_ids", "max_tokens", "temperature", "top_p", "stop_token_ids", "thinking_budget", "seed",
           "routed_experts_prompt_start", "ignore_eos", "images")


def check_request(d: Any, limits: PolicyLimits) -> GenerateRequest:
    """A `GenerateRequest` from its JSON form, every field inside the engine's ranges; BadRequest otherwise."""
    if not isinstance(d, dict):
        raise BadRequest(f"a request must be a JSON object, got {type(d).__name__}")
    extra = sorted(set(d) - set(_FIELDS))
    if extra:
        raise BadRequest(f"unknown request field(s) {short(extra)}; allowed: {list(_FIELDS)}")
    n = limits.max_model_len
    prompt = _ids(d, "prompt_token_ids", limits, 1, n - 1)  # the engine needs room for one generated token
    if d.get("images", []) != []:
        raise BadRequest("images are not served here (agent jobs are text-only)")
    ignore_eos = d.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be true or false, got {short(ignore_eos)}")
    return GenerateRequest(
        prompt_token_ids=prompt, max_tokens=_int(d, "max_tokens", 1, n), temperature=_float(d, "temperature", 0.0, MAX_TEMPERATURE, 1.0),
        top_p=_float(d, "top_p", 0.0, 1.0, 1.0, lo_open=True), stop_token_ids=_ids(d, "stop_token_ids", limits, 0, MAX_STOP_IDS),
        thinking_budget=_int(d, "thinking_budget", 0, n, None), seed=_int(d, "seed", 0, SEED_MAX, None),
        routed_experts_prompt_start=_int(d, "routed_experts_prompt_start", 0, len(prompt), 0), ignore_eos=ignore_eos)


def check_score(body: Any, limits: PolicyLimits) -> list[list[int]]:
    if not isinstance(body, list) or not 1 <= len(body) <= MAX_REQUESTS:
        raise BadRequest(f"the body must be a list of 1 to {MAX_REQUESTS} token sequences")
    return [list(_ids({"sequence": s}, "sequence", limits, 2, limits.max_model_len - 1)) for s in body]


def result_to_json(r: GenerateResult) -> dict[str, Any]:
    # routed experts are not sent: the CPU engine never reports them, and jobs do not replay routes
    return {"token_ids": list(r.token_ids), "logprobs": list(r.logprobs), "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason, "policy_version": r.policy_version, "first_policy_version": r.first_policy_version}


def result_from_json(d: dict[str, Any]) -> GenerateResult:
    return GenerateResult(token_ids=tuple(d["token_ids"]), logprobs=tuple(d["logprobs"]), finish_reason=d["finish_reason"],
                          stop_reason=d["stop_reason"], policy_version=d["policy_version"],
                          first_policy_version=d["first_policy_version"])


def build_app(engine: Any, limits: PolicyLimits, api_key: str):
    """The FastAPI app over a started engine (anything with `submit` and `score` like `RolloutEngine`); every
    route needs `api_key`."""
    from fastapi import FastAPI, HTTPException

    from rl.rollout.engine_platform import EngineError

    app = FastAPI(title="jointrl policy", docs_url=None, redoc_url=None, openapi_url=None)

    async def body_of(request: Request) -> Any:
        try:
            return await read_json(request, MAX_BODY_BYTES)
        except BodyError as e:
            raise HTTPException(status_code=e.status, detail=e.detail) from None

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "model": engine.config.model_path, "policy_version": engine.policy_version}

    @app.post("/generate")
    async def generate(request: Request) -> list[dict]:
        body = await body_of(request)
        try:
            if not isinstance(body, list) or not 1 <= len(body) <= MAX_REQUESTS:
                raise BadRequest(f"the body must be a list of 1 to {MAX_REQUESTS} requests")
            reqs = [check_request(d, limits) for d in body]
            futures = engine.submit(reqs)
        except (BadRequest, EngineError) as e:  # EngineError here: refused before anything reached the engine
            raise HTTPException(status_code=400, detail=str(e)[:2000]) from None
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return [result_to_json(r) for r in results]

    @app.post("/score")
    async def score(request: Request) -> list[list[float]]:
        body = await body_of(request)
        try:
            seqs = check_score(body, limits)
        except BadRequest as e:
            raise HTTPException(status_code=400, detail=str(e)[:2000]) from None
        out = await asyncio.to_thread(engine.score, seqs)
        return [x.tolist() for x in out]

    app.add_middleware(KeyGate, keys=(check_key(api_key, f"${POLICY_KEY_ENV}"),))
    return app


def policy_limits(model_path: str, max_model_len: int) -> PolicyLimits:
    """The vocabulary size from the checkpoint's config.json (a multimodal config keeps it in text_config)."""
    cfg = json.loads(Path(model_path, "config.json").read_text())
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ConfigError(f"{model_path}/config.json: no vocab_size")
    return PolicyLimits(vocab_size=vocab, max_model_len=max_model_len)


class RemotePolicy:
    """Client of a policy server; `generate_batch` plugs into `BatchingGenerator`. The key defaults to
    `$JOINTRL_POLICY_API_KEY` (set by the jobs server for its workers)."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout_s
        self._headers = policy_headers(api_key)
        self._client: httpx.AsyncClient | None = None

    async def generate_batch(self, reqs: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if self._client is None:  # made on first use: it belongs to the event loop that runs the episode
            self._client = httpx.AsyncClient(timeout=self._timeout, headers=self._headers)
        r = await self._client.post(f"{self.url}/generate", json=[request_to_json(q) for q in reqs])
        r.raise_for_status()
        return [result_from_json(d) for d in r.json()]

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def policy_headers(api_key: str | None = None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(POLICY_KEY_ENV)
    return {} if key is None else {"x-api-key": key}


def wait_healthy(url: str, timeout_s: float, proc: Any = None, api_key: str | None = None) -> None:
    """Poll GET /health until it answers (bounded); raises naming the URL, or the process's exit code. A 401
    (the key is wrong or missing) is an error at once."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the policy server for {url} exited with code {proc.returncode} during start-up")
        try:
            code = httpx.get(f"{url}/health", timeout=2, headers=policy_headers(api_key)).status_code
            if code == 200:
                return
            if code == 401:
                raise ConfigError(f"the policy server at {url} refused the key (set ${POLICY_KEY_ENV} to its key)")
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the policy server at {url} did not answer /health within {timeout_s:.0f}s")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl.jobs.policy", description=__doc__.splitlines()[0])
    p.add_argument("model", help="a model argument as `jointrl jobs serve` takes it (rl/model_arg.py): checkpoint dir, URL, pullable or shipped name")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    from rl.http_run import run_until_stopped

    from rl.jobs.records import MAX_MODEL_LEN
    from rl.log import setup_logging
    from rl.rollout.engine import EngineConfig, RolloutEngine
    from rl.model_arg import ModelArgError, resolve_model

    setup_logging()
    try:
        key = check_key(os.environ.get(POLICY_KEY_ENV), f"${POLICY_KEY_ENV} (the key every client of this server must send)")
    except ConfigError as e:
        print(f"rl.jobs.policy: config error: {e}", file=sys.stderr)
        return 2
    try:
        model_path = str(resolve_model(args.model).checkpoint())
    except ModelArgError as e:
        print(f"rl.jobs.policy: {e}", file=sys.stderr)
        return 2
    limits = policy_limits(model_path, MAX_MODEL_LEN)
    engine = RolloutEngine(EngineConfig(model_path=model_path, max_model_len=MAX_MODEL_LEN, dtype="auto"))
    try:
        run_until_stopped(build_app(engine, limits, key), "127.0.0.1", args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
