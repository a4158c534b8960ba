"""The served policy the agent workers generate with: one `RolloutEngine` behind a token-level HTTP endpoint.

`python -m rl.jobs.policy MODEL --port P` serves `POST /generate` (a list of `GenerateRequest`s in, a
list of `GenerateResult`s out, token ids and logprobs, no chat templates), `POST /score` (the engine's
logprobs of given sequences) and `GET /health`. Concurrent requests from many workers join the
engine's continuous batching. `RemotePolicy(url).generate_batch` is the client side, the callable the
agent loop's `BatchingGenerator` takes, so an agent job runs the same `run_episode` as training does.

Token-level on purpose: the episode a job records is exactly the tokens the engine sampled, with
their logprobs, so done jobs can feed training (the OpenAI endpoint of rl/serve.py re-renders text).

What this module does not do: decide which engine settings a run uses beyond max_model_len (defaults
of `EngineConfig`), or serve anything but loopback clients by default.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict, fields
from typing import Any, Sequence

import httpx

from rl.rollout.engine import GenerateRequest, GenerateResult

_REQ_FIELDS = {f.name for f in fields(GenerateRequest)}


def request_to_json(r: GenerateRequest) -> dict[str, Any]:
    d = asdict(r)
    d["prompt_token_ids"] = list(r.prompt_token_ids)
    d["stop_token_ids"] = list(r.stop_token_ids)
    return d


def request_from_json(d: dict[str, Any]) -> GenerateRequest:
    extra = set(d) - _REQ_FIELDS
    if extra:
        raise ValueError(f"unknown GenerateRequest field(s) {sorted(extra)}")
    return GenerateRequest(**{**d, "prompt_token_ids": tuple(d["prompt_token_ids"]), "stop_token_ids": tuple(d.get("stop_token_ids", ()))})


def result_to_json(r: GenerateResult) -> dict[str, Any]:
    # routed experts are not sent: the CPU engine never reports them, and jobs do not replay routes
    return {"token_ids": list(r.token_ids), "logprobs": list(r.logprobs), "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason, "policy_version": r.policy_version, "first_policy_version": r.first_policy_version}


def result_from_json(d: dict[str, Any]) -> GenerateResult:
    return GenerateResult(token_ids=tuple(d["token_ids"]), logprobs=tuple(d["logprobs"]), finish_reason=d["finish_reason"],
                          stop_reason=d["stop_reason"], policy_version=d["policy_version"],
                          first_policy_version=d["first_policy_version"])


def build_app(engine: Any):
    """The FastAPI app over a started engine (anything with `submit` and `score` like `RolloutEngine`)."""
    from fastapi import Body, FastAPI, HTTPException

    app = FastAPI(title="jointrl policy")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "model": engine.config.model_path, "policy_version": engine.policy_version}

    @app.post("/generate")
    async def generate(body: list[dict] = Body(...)) -> list[dict]:
        try:
            reqs = [request_from_json(d) for d in body]
            futures = engine.submit(reqs)
        except (ValueError, TypeError, KeyError) as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return [result_to_json(r) for r in results]

    @app.post("/score")
    async def score(body: list[list[int]] = Body(...)) -> list[list[float]]:
        out = await asyncio.to_thread(engine.score, body)
        return [x.tolist() for x in out]

    return app


class RemotePolicy:
    """Client of a policy server; `generate_batch` plugs into `BatchingGenerator`."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def generate_batch(self, reqs: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if self._client is None:  # made on first use: it belongs to the event loop that runs the episode
            self._client = httpx.AsyncClient(timeout=self._timeout)
        r = await self._client.post(f"{self.url}/generate", json=[request_to_json(q) for q in reqs])
        r.raise_for_status()
        return [result_from_json(d) for d in r.json()]

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def wait_healthy(url: str, timeout_s: float, proc: Any = None) -> None:
    """Poll GET /health until it answers (bounded); raises naming the URL, or the process's exit code."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the policy server for {url} exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the policy server at {url} did not answer /health within {timeout_s:.0f}s")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl.jobs.policy", description=__doc__.splitlines()[0])
    p.add_argument("model", help="checkpoint directory, or a file:// / s3:// URL of an exported one (pulled first)")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    from rl.http_run import run_until_stopped

    from rl.jobs.records import MAX_MODEL_LEN
    from rl.log import setup_logging
    from rl.rollout.engine import EngineConfig, RolloutEngine
    from rl.weights.objstore import resolve_model

    setup_logging()
    engine = RolloutEngine(EngineConfig(model_path=str(resolve_model(args.model)), max_model_len=MAX_MODEL_LEN, dtype="auto"))
    try:
        run_until_stopped(build_app(engine), "127.0.0.1", args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
