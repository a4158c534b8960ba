"""The HTTP app and entry point of `jointrl serve`: routes, auth, body limits, admission, streaming responses, model preparation.

What it does
- `create_app(service, api_key)`: FastAPI routes `/v1/chat/completions` (rl.serve.openai),
  `/v1/responses` (rl.serve.responses), `/v1/messages` and `/v1/messages/count_tokens` (rl.serve.anthropic),
  `/v1/models`, `/health`, `/metrics` (Prometheus text). Errors use the route's protocol shape (Anthropic's under
  `/v1/messages`, OpenAI's elsewhere), never a bare 500 for a bad request.
- An ASGI gate in front of every route: a per-client rate limit (rl/ratelimit.py: a token bucket per
  client address, `rate_limit_per_s` / `rate_limit_burst`; past it 429 with `Retry-After`, answered before
  the key check and before any body byte is read), the API key (`Authorization: Bearer K` or `x-api-key: K`;
  401 otherwise; an empty or blank key is refused when the app is built) and per-route request counting.
  `/health` answers without the key, and then only `{"status": "ok"}`.
- Bodies that are not JSON, not UTF-8, nested past 64 levels or hold lone surrogates are a 400.
- Request bodies larger than `max_body_bytes` get 413 (checked on Content-Length and while reading);
  a full admission queue gets 429 with `Retry-After`.
- A client that disconnects (streamed or not) cancels its request: the engine request is aborted
  at once (`rl.serve.service.ChatService.run`).
- `prepare_model` / `build_service` / `main`: resolve the model argument (rl/model_arg.py, the resolver
  `jointrl train`, `eval` and `jobs` use too), pick the chat codec the way training does (rl/serve/codec.py), build the engine, serve.

What it does not do
- No TLS (put a proxy in front), no per-key quotas (the one API key names no client; the rate limit goes by
  address, so behind a proxy every client is the proxy: raise or turn off the limit there).
"""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from starlette.requests import Request  # module level: FastAPI resolves the handlers' (string) annotations here

from rl.log import get_logger
from rl.ratelimit import RateLimiter, client_id
from rl.serve import anthropic as anth
from rl.serve import openai as oai
from rl.serve import responses as resp
from rl.serve.codec import ServeCodec, build_codec
from rl.serve.core import MAX_JSON_DEPTH, ApiError, bad, check_body_tree
from rl.serve.records import Recorder
from rl.serve.service import ChatService, Prepared
from rl.serve.settings import EFFORTS, TIERS, ServeArgs, ServeError, ServeSettings, check_api_key, key_in_headers

log = get_logger("serve")

ANTHROPIC_PREFIX = "/v1/messages"

# Request-body schemas for the OpenAPI document (clients and route fuzzing read them). The handlers
# validate bodies themselves (rl.serve.openai / rl.serve.anthropic), so these only describe the shape.
_MSG_CONTENT = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {"type": "object"}}]}
CHAT_BODY_SCHEMA = {
    "type": "object", "required": ["messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]}, "content": _MSG_CONTENT,
            "tool_calls": {"type": "array", "items": {"type": "object"}}, "tool_call_id": {"type": "string"},
            "reasoning_content": {"type": ["string", "null"]}}}},
        "tools": {"type": "array", "items": {"type": "object"}}, "tool_choice": {},
        "thinking_budget": {"anyOf": [{"type": "string", "enum": list(EFFORTS)}, {"type": "integer"}]},
        "reasoning_effort": {"type": "string", "enum": list(EFFORTS)}, "extra_body": {"type": "object"},
        "top_logprobs": {"type": "integer"},
        "max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}, "temperature": {"type": "number"},
        "top_p": {"type": "number"}, "seed": {"type": "integer"}, "n": {"type": "integer"}, "stop": {},
        "stream": {"type": "boolean"}, "stream_options": {"type": "object"}, "logprobs": {"type": "boolean"},
    },
}
MESSAGES_BODY_SCHEMA = {
    "type": "object", "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string"}, "max_tokens": {"type": "integer"},
        "messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["text", "thinking", "tool_use", "tool_result", "image"]}}}}]}}}},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "tools": {"type": "array", "items": {"type": "object"}}, "tool_choice": {"type": "object"},
        "thinking": {"type": "object", "properties": {"type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]},
                                                      "budget_tokens": {"type": "integer"}}},
        "thinking_budget": {"anyOf": [{"type": "string", "enum": list(TIERS)}, {"type": "integer"}]},
        "stop_sequences": {"type": "array", "items": {"type": "string"}}, "temperature": {"type": "number"},
        "top_p": {"type": "number"}, "stream": {"type": "boolean"}, "metadata": {"type": "object"},
    },
}

RESPONSES_BODY_SCHEMA = {
    "type": "object", "required": ["input"],
    "properties": {
        "model": {"type": "string"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "properties": {
            "type": {"type": "string", "enum": ["message", "function_call", "function_call_output", "reasoning"]},
            "role": {"type": "string", "enum": ["user", "system", "developer", "assistant"]}, "content": _MSG_CONTENT,
            "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"}, "output": {"type": "string"}}}}]},
        "instructions": {"type": "string"}, "tools": {"type": "array", "items": {"type": "object"}}, "tool_choice": {},
        "reasoning": {"type": "object", "properties": {"effort": {"type": "string", "enum": list(EFFORTS)}}},
        "max_output_tokens": {"type": "integer"}, "temperature": {"type": "number"}, "top_p": {"type": "number"},
        "stream": {"type": "boolean"}, "store": {"type": "boolean"}, "previous_response_id": {"type": "string"},
        "include": {"type": "array", "items": {"type": "string"}}, "metadata": {"type": "object"},
    },
}


def _body_spec(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _error_response(path: str, e: ApiError) -> Any:
    from fastapi.responses import JSONResponse

    body = anth.error_body(e) if path.startswith(ANTHROPIC_PREFIX) else e.body()
    return JSONResponse(status_code=e.status, content=body, headers=e.headers)


class _Gate:
    """ASGI middleware: the per-client rate limit and the API-key check on every HTTP route, and request counting
    by route and status."""

    def __init__(self, app: Any, api_key: str | None, service: ChatService) -> None:
        self.app, self.key, self.service = app, check_api_key(api_key), service
        s = service.settings
        self.limiter = RateLimiter(s.rate_limit_per_s, s.rate_limit_burst)

    def _authorised(self, headers: list[tuple[bytes, bytes]]) -> bool:
        return key_in_headers(headers, self.key)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        wait = self.limiter.take(client_id(scope))
        if wait is not None:  # refused before the key check and the body: the cheapest answer the server has
            self.service.metrics.requests.labels(route, "429").inc()
            resp = _error_response(path, ApiError(
                429, self.limiter.refusal(),
                type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": self.limiter.retry_after(wait)}))
            return await resp(scope, receive, send)
        authorised = self._authorised(scope["headers"])
        scope.setdefault("state", {})["authorised"] = authorised
        if not authorised and path not in _OPEN_ROUTES:
            self.service.metrics.requests.labels(route, "401").inc()
            resp = _error_response(path, ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                                  type="authentication_error", code="invalid_api_key",
                                                  headers={"WWW-Authenticate": "Bearer"}))
            return await resp(scope, receive, send)
        status = ["500"]

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.service.metrics.requests.labels(route, status[0]).inc()


_ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/models", "/health", "/metrics")
# Answered without the key (load balancers' probes); without it they say nothing about the server's state.
_OPEN_ROUTES = ("/health",)


async def read_json(request: Request, limit: int) -> Any:
    """The decoded body; 413 past `limit` bytes (before reading when Content-Length says so)."""
    too_big = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
                       code="request_too_large")
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as e:  # includes bytes that are not UTF-8 and integers past Python's 4,300 digits
        raise bad(f"the request body is not valid JSON: {str(e)[:200]}", None, "invalid_json") from None
    except RecursionError:
        raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from None
    check_body_tree(body)
    return body


async def _until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _event_stream(content: Any, on_close: Callable[[], None]) -> Any:
    """An SSE response that stops (and closes `content`, aborting the generation) as soon as the client disconnects."""
    import anyio
    from starlette.responses import StreamingResponse

    class EventStream(StreamingResponse):
        async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
            try:
                async with anyio.create_task_group() as tg:
                    async def stream() -> None:
                        try:
                            await self.stream_response(send)
                        except OSError:  # the client went away mid-write
                            pass
                        tg.cancel_scope.cancel()

                    async def listen() -> None:
                        await _until_disconnect(receive)
                        tg.cancel_scope.cancel()

                    tg.start_soon(stream)
                    tg.start_soon(listen)
            finally:
                on_close()

    return EventStream(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(service: ChatService, api_key: str | None = None):
    """The FastAPI app over one service. Every error reply, including unknown routes, uses the route's error shape."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    api_key = check_api_key(api_key)  # an empty or blank key is refused here, before anything listens
    app = FastAPI(title="jointrl serve", docs_url=None, redoc_url=None)
    settings = service.settings
    tool_args = anth.ArgumentTexts(settings.token_cache_entries)
    response_store = resp.ResponseStore(settings.token_cache_entries)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error_response(request.url.path, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error_response(request.url.path, ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(request.url.path, ApiError(400, f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):
        log.exception("request failed")
        return _error_response(request.url.path, ApiError(500, f"internal server error: {e!r}", type="server_error"))

    async def admit() -> None:
        await service.admission.acquire(service.retry_after_s())

    async def reply(request: Request, prep: Prepared, route: str, plain: Callable[[Any], Any], stream: Callable[[Any], Any]):
        await admit()
        if prep.req.stream:
            return _event_stream(stream(service.run(prep, route)), service.admission.release)
        try:
            task = asyncio.ensure_future(service.complete(prep, route))
            watch = asyncio.ensure_future(_until_disconnect(request.receive))
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client went away: stop generating for it
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)
            watch.cancel()
            return plain(task.result())
        finally:
            service.admission.release()

    @app.get("/health")
    async def health(request: Request):
        if not request.scope.get("state", {}).get("authorised", False):
            return {"status": "ok"}
        load = service.engine.load() if hasattr(service.engine, "load") else None
        return {"status": "ok", "requests": service.requests, "inflight": service.inflight, "peak_inflight": service.peak_inflight,
                "queued": service.admission.waiting, "policy_version": service.engine.policy_version,
                "engine_running": None if load is None else load.running, "engine_waiting": None if load is None else load.waiting,
                "kv_cache_usage": None if load is None else load.kv_cache_usage}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        m = service.metrics
        m.queue_depth.set(service.admission.waiting)
        m.running.set(service.inflight)
        if hasattr(service.engine, "load"):
            load = service.engine.load()
            m.engine_running.set(load.running)
            m.kv_usage.set(load.kv_cache_usage)
        m.refresh()
        return PlainTextResponse(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return service.models_json()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in service.model_names:
            raise ApiError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
        return next(d for d in service.models_json()["data"] if d["id"] == model_id) if model_id in service.listed_names else \
            {**service.models_json()["data"][0], "id": model_id}

    @app.post("/v1/chat/completions", openapi_extra=_body_spec(CHAT_BODY_SCHEMA))
    async def chat_completions(request: Request):
        body = await read_json(request, settings.max_body_bytes)
        req = oai.parse_chat_request(body, settings, service.model_names, service.codec)
        prep = service.prepare(req)
        return await reply(request, prep, "/v1/chat/completions",
                           lambda choices: oai.completion_json(prep.id, prep.created, req.model, prep.n_prompt, choices,
                                                               service.tokenizer, req.logprobs, req.top_logprobs),
                           lambda events: oai.sse_events(prep, events))

    @app.post("/v1/messages", openapi_extra=_body_spec(MESSAGES_BODY_SCHEMA))
    async def messages(request: Request):
        body = await read_json(request, settings.max_body_bytes)
        req = anth.parse_messages_request(body, settings, service.model_names, service.codec, tool_args)
        prep = service.prepare(req)
        return await reply(request, prep, "/v1/messages", lambda choices: anth.message_json(prep, choices[0], tool_args),
                           lambda events: anth.sse_events(prep, events, tool_args))

    @app.post("/v1/responses", openapi_extra=_body_spec(RESPONSES_BODY_SCHEMA))
    async def responses(request: Request):
        body = await read_json(request, settings.max_body_bytes)
        call = resp.parse_responses_request(body, settings, service.model_names, service.codec, response_store)
        prep = service.prepare(call.req)

        def plain(choices: Any) -> Any:
            c = choices[0]
            resp.remember(response_store, prep, call, c)
            return resp.response_json(prep, call, c, resp.output_items(resp.ItemIds.new(), c, call))

        return await reply(request, prep, "/v1/responses", plain, lambda events: resp.sse_events(prep, call, events, response_store))

    @app.post("/v1/messages/count_tokens", openapi_extra=_body_spec({**MESSAGES_BODY_SCHEMA, "required": ["model", "messages"]}))
    async def count_tokens(request: Request):
        body = await read_json(request, settings.max_body_bytes)
        req = anth.parse_messages_request(body, settings, service.model_names, service.codec, tool_args, count_only=True)
        return JSONResponse({"input_tokens": service.count_tokens(req)})

    app.add_middleware(_Gate, api_key=api_key, service=service)
    return app


# ============================================================================ model preparation
@dataclass(frozen=True)
class PreparedModel:
    path: Path  # HF checkpoint directory (config.json, weights, tokenizer files)
    served_names: tuple[str, ...]
    dtype: str  # float32 / bfloat16
    is_hybrid: bool


def prepare_model(model_or_ckpt: str, settings: ServeSettings) -> PreparedModel:
    """Resolve the `MODEL_OR_CKPT` argument (rl/model_arg.py, as `jointrl train` reads `model.arch`) to a
    checkpoint directory vLLM can load; a shipped config gets random weights of `settings.seed` in the cache."""
    from rl.model_arg import ModelArgError, resolve_model

    try:
        arg = resolve_model(model_or_ckpt)
        path = arg.checkpoint(settings.seed, settings.cache_dir)
    except ModelArgError as e:
        raise ServeError(str(e)) from None
    name = arg.name
    cfg = json.loads((path / "config.json").read_text())
    is_hybrid = cfg.get("model_type") == "hybrid_moe" or "HybridMoeForCausalLM" in (cfg.get("architectures") or [])
    has_delta = "linear_attention" in (cfg.get("layer_types") or [])
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if has_delta else "float32"  # vLLM's CPU delta-rule kernel requires bf16 (docs/platform.md)
    return PreparedModel(path=path, served_names=tuple(dict.fromkeys(settings.served_names)) or (name,), dtype=dtype, is_hybrid=is_hybrid)


def engine_config(prepared: PreparedModel, settings: ServeSettings, codec: ServeCodec) -> Any:
    """The engine for a prepared model: the serving settings, thinking budgets on the codec's thinking
    markers (none for a format without them), and the shipped tokenizer for a `jointrl` checkpoint without one."""
    from model import chat
    from rl.rollout.engine import EngineConfig

    markers = codec.reasoning_markers
    own_tokenizer = (prepared.path / "tokenizer.json").is_file()
    return EngineConfig(
        model_path=str(prepared.path), dtype=prepared.dtype, max_model_len=settings.max_model_len, kv_cache_gib=settings.kv_cache_gib,
        enforce_eager=settings.enforce_eager, seed=settings.seed, max_num_seqs=settings.max_running,
        tokenizer=None if own_tokenizer or not codec.is_project_format else str(chat.TOKENIZER_DIR),
        reasoning_start=markers[0] if markers else None, reasoning_end=markers[1] if markers else None,
        max_images_per_prompt=codec.max_images)


def build_service(model_or_ckpt: str, settings: ServeSettings, record_dir: str | None) -> ChatService:
    from rl.serve.engine import StreamingEngine

    prepared = prepare_model(model_or_ckpt, settings)
    codec = build_codec(prepared.path, settings)
    log.info("chat codec: %s (--chat-codec %s)", codec.describe(), settings.chat_codec)
    engine = StreamingEngine(engine_config(prepared, settings, codec))
    aliases = tuple(n for n in (model_or_ckpt,) if n not in prepared.served_names)
    recorder = Recorder(record_dir) if record_dir else None
    if recorder is not None:
        log.info("recording requests to %s", recorder.path)
    return ChatService(engine, codec, settings, prepared.served_names, settings.max_model_len, recorder, aliases=aliases)


def serve(args: ServeArgs) -> int:
    """Build the service and run uvicorn until interrupted; returns an exit code."""
    from rl.log import setup_logging
    from rl.paths import setup_cache_env

    setup_logging()
    setup_cache_env()
    try:
        service = build_service(args.model, args.settings, args.record_dir)
    except ServeError as e:
        print(f"jointrl serve: {e}", file=sys.stderr)
        return 2
    from rl.http_run import run_until_stopped

    app = create_app(service, args.api_key)
    log.info("serving %s on http://%s:%d/v1 (max_model_len %d, auth %s)", list(service.model_names), args.host, args.port,
             args.settings.max_model_len, "on" if args.api_key else "off")
    try:
        run_until_stopped(app, args.host, args.port, log_level="warning", access_log=False)
    finally:
        service.engine.shutdown()  # type: ignore[attr-defined]
    return 0


def main_from_args(ns: Any) -> int:
    """Entry point of `jointrl serve ...` (rl/cli.py) with its parsed flags."""
    from rl.serve.settings import from_args

    try:
        args = from_args(ns)
    except ServeError as e:
        print(f"jointrl serve: {e}", file=sys.stderr)
        return 2
    return serve(args)


def main(model: str, host: str = "127.0.0.1", port: int = 8000, record_dir: str | None = None,
         settings: ServeSettings | None = None, api_key: str | None = None) -> int:
    """Programmatic entry point; see `serve`."""
    return serve(ServeArgs(model, host, port, record_dir, api_key, settings or ServeSettings()))


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m rl.serve`: the same flags as `jointrl serve`."""
    import argparse

    from rl.serve.settings import add_arguments

    p = argparse.ArgumentParser(prog="python -m rl.serve", description=__doc__.split("\n")[0])
    add_arguments(p)
    return main_from_args(p.parse_args(argv))
