"""`jointrl tinker serve MODEL`: the Tinker REST protocol over HTTP, as the official `tinker` SDK (0.38.0) speaks it.

Routes (all under /api/v1; the SDK's base URL is the server's root): the start-up calls (`client/config`,
`client/dynamic_config`, `create_session`, `session_heartbeat`, `sessions/{id}/finish`, `telemetry`,
`healthz`, `get_server_capabilities`), training (`create_model`, `get_info`, `forward_backward` in
protobuf, `optim_step`, `save_weights`, `load_weights`, `save_weights_for_sampler`), sampling
(`create_sampling_session`, `samplers/{id}`, `asample`) and futures (`retrieve_future`, `cancel_future`).

Errors: a refused request answers 4xx with `{"detail": message}` (the SDK raises `BadRequestError`,
`NotFoundError`, ... with it; 429 is retried by the SDK); a queued request that fails answers its future with
`{"error", "category"}` (raised as `RequestFailedError`). An unexpected fault inside a route is also a
4xx-free, non-retried answer: a failed future where a future exists, else 400 with the fault named, so a
client never sits in the SDK's retry loop for 5xx.

Auth: the SDK sends its key as `X-API-Key` (it must start with `tml-`). With `--api-key` (or
$JOINTRL_API_KEY) every route but `healthz` needs it; without one the server binds loopback only.

What this module does not do: the state and queues (rl/tinker/service.py), the protobuf codec
(rl/tinker/wire.py), training or sampling (rl/tinker/models.py, rl/tinker/sampling.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from fastapi import Request  # module level: the routes' annotations are strings FastAPI resolves here

from rl.http_io import BodyTooLarge, read_body
from rl.log import get_logger
from rl.serve.settings import key_in_headers
from rl.tinker.records import (CreateModelBody, CreateSamplingBody, LoadWeightsBody, ModelBody, OptimStepBody,
                               RetrieveBody, SampleBody, SaveForSamplerBody, SaveWeightsBody, SessionBody)
from rl.tinker.service import Future, TinkerError, TinkerLimits, TinkerService

log = get_logger("tinker")

PREFIX = "/api/v1"
PROTO = "application/x-protobuf"
OPEN_ROUTES = (f"{PREFIX}/healthz",)


class _Gate:
    """ASGI middleware: the API key on every route but the health probe, and the body-size bound."""

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app, self.key, self.max_body = app, api_key, max_body

    def _authorised(self, headers: list[tuple[bytes, bytes]]) -> bool:
        return key_in_headers(headers, self.key)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        from starlette.responses import JSONResponse

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] not in OPEN_ROUTES and not self._authorised(scope["headers"]):
            return await JSONResponse({"detail": "missing or wrong API key (X-API-Key)"}, status_code=401)(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body:
                return await JSONResponse({"detail": f"request body over {self.max_body} bytes"}, status_code=413)(scope, receive, send)
        return await self.app(scope, receive, send)


async def _body(request: Any, limit: int) -> bytes:
    """The request body, bounded (rl/http_io.read_body), then zstd-decoded when the client compressed it."""
    try:
        data = await read_body(request, limit)
    except BodyTooLarge:
        raise TinkerError(413, f"request body over {limit} bytes") from None
    if request.headers.get("content-encoding", "").lower() == "zstd":
        import zstandard

        try:
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
        except zstandard.ZstdError as e:
            raise TinkerError(400, f"zstd body: {e}") from None
        if len(data) > limit:
            raise TinkerError(413, f"request body over {limit} bytes once decompressed")
    return data


def _future_json(f: Future, model_id: str | None = None, **extra: Any) -> dict:
    out = {"request_id": f.request_id}
    if model_id is not None:
        out["model_id"] = model_id
    out.update(extra)
    return out


def create_app(service: TinkerService, api_key: str | None = None):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="jointrl tinker", docs_url=None, redoc_url=None, openapi_url=None)
    limits = service.limits
    app.add_middleware(_Gate, api_key=api_key, max_body=limits.max_body_bytes)

    @app.exception_handler(TinkerError)
    async def _tinker_error(request: Request, e: TinkerError):
        return JSONResponse({"detail": e.message}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors()[:5])
        return JSONResponse({"detail": f"malformed request: {errs}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse({"detail": str(e.detail)}, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _fault(request: Request, e: Exception):  # never a 5xx: the SDK would retry it for minutes
        log.exception("tinker route %s failed", request.url.path)
        return JSONResponse({"detail": f"the service failed on this request: {type(e).__name__}: {e}"}, status_code=400)

    async def json_body(request: Request, cls: type) -> Any:
        import json

        from pydantic import ValidationError

        raw = await _body(request, limits.max_body_bytes)
        try:
            return cls.model_validate(json.loads(raw or b"{}"))
        except (ValueError, ValidationError) as e:
            raise TinkerError(400, f"malformed {cls.__name__}: {str(e)[:500]}") from None

    @app.get(f"{PREFIX}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post(f"{PREFIX}/client/config")
    async def client_config():
        # parallel_fwdbwd_chunks off: a client's chunks arrive in its sequence order, which the per-model queue keeps.
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": False, "fwdbwd_max_chunk_len": limits.max_datums,
                "fwdbwd_max_chunk_bytes_count": min(5_000_000, limits.max_body_bytes // 2), "use_pyqwest_transport": False,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False, "sample_join_sampling_session": False,
                "sample_max_concurrent_requests": limits.queue_depth}

    @app.post(f"{PREFIX}/client/dynamic_config")
    async def dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get(f"{PREFIX}/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.served_name, "max_context_length": service.max_model_len,
                                      "trainable": True, "sampleable": service._engine_factory is not None}]}

    @app.post(f"{PREFIX}/create_session")
    async def create_session():
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post(f"{PREFIX}/session_heartbeat")
    async def heartbeat(request: Request):
        b = await json_body(request, SessionBody)
        service.heartbeat(b.session_id)
        return {"type": "session_heartbeat"}

    @app.post(f"{PREFIX}/sessions/{{session_id}}/finish")
    async def finish(session_id: str):
        service.finish_session(session_id)
        return {}

    @app.post(f"{PREFIX}/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.post(f"{PREFIX}/cancel_future")
    async def cancel_future():
        return {}

    @app.post(f"{PREFIX}/create_model")
    async def create_model(request: Request):
        from rl.tinker.models import LoraRequest

        b = await json_body(request, CreateModelBody)
        if b.lora_config is None:
            raise TinkerError(400, "create_model without lora_config (full fine-tuning) is not supported; send a LoRA rank")
        if b.optimizer_config.type != "adamw":
            raise TinkerError(400, f"optimizer {b.optimizer_config.type!r} is not supported; only adamw")
        lc = b.lora_config
        lora = LoraRequest(rank=lc.rank, seed=int(lc.seed or 0), train_attn=lc.train_attn, train_mlp=lc.train_mlp,
                           train_unembed=lc.train_unembed)
        f = service.create_model(b.session_id, b.model_seq_id, b.base_model, lora)
        return _future_json(f, f"{b.session_id}:train:{b.model_seq_id}")

    @app.post(f"{PREFIX}/get_info")
    async def get_info(request: Request):
        return service.get_info((await json_body(request, ModelBody)).model_id)

    @app.post(f"{PREFIX}/forward_backward")
    async def forward_backward(request: Request):
        from rl.tinker.losses import LOSS_INPUTS, OPTIONAL_INPUTS, LossRequestError, check_loss
        from rl.tinker.models import Datum
        from rl.tinker.wire import WireError, decode_forward_backward

        if PROTO not in request.headers.get("content-type", ""):
            raise TinkerError(400, f"forward_backward takes a protobuf body ({PROTO}), as the tinker SDK sends it")
        raw = await _body(request, limits.max_body_bytes)
        try:
            req = decode_forward_backward(raw, limits.max_datums, limits.max_batch_tokens)
        except WireError as e:
            raise TinkerError(400, f"malformed ForwardBackwardRequest: {e}") from None
        service.model(req.model_id)
        config = dict(req.loss_fn_config)
        try:
            check_loss(req.loss_fn, config)
        except LossRequestError as e:
            raise TinkerError(400, str(e)) from None
        data = []
        for i, d in enumerate(req.data):
            if d.non_text_chunks:
                raise TinkerError(400, f"datum {i}: only encoded_text chunks are supported (no image or audio input)")
            inputs = {}
            for name, t in d.inputs:
                if len(t.shape) != 1:
                    raise TinkerError(400, f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(t.shape)}; expected 1-D")
                inputs[name] = t.values.astype(np.int64 if name == "target_tokens" else np.float32)
            data.append(Datum(d.tokens, inputs))
        service.check_data(data, LOSS_INPUTS[req.loss_fn], OPTIONAL_INPUTS.get(req.loss_fn, ()))
        f = service.forward_backward(req.model_id, data, req.loss_fn, config, req.forward_only)
        return _future_json(f, req.model_id)

    @app.post(f"{PREFIX}/optim_step")
    async def optim_step(request: Request):
        from rl.tinker.models import AdamStep

        b = await json_body(request, OptimStepBody)
        a = b.adam_params
        if a is None or (a.type not in (None, "adam", "adamw")):
            raise TinkerError(400, "optim_step: only adam_params (AdamW) are supported")
        if not a.learning_rate >= 0:
            raise TinkerError(400, "adam_params.learning_rate must be >= 0")
        f = service.optim_step(b.model_id, AdamStep(a.learning_rate, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_clip_norm))
        return _future_json(f, b.model_id)

    @app.post(f"{PREFIX}/save_weights")
    async def save_weights(request: Request):
        b = await json_body(request, SaveWeightsBody)
        return _future_json(service.save_state(b.model_id, b.path, b.overwrite), b.model_id)

    @app.post(f"{PREFIX}/load_weights")
    async def load_weights(request: Request):
        b = await json_body(request, LoadWeightsBody)
        if b.model_id is None:
            raise TinkerError(400, "load_weights into a new model (create-via-load) is not supported; create a LoRA "
                                   "training client, then load_state on it")
        return _future_json(service.load_state(b.model_id, b.path, b.optimizer), b.model_id)

    @app.post(f"{PREFIX}/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        b = await json_body(request, SaveForSamplerBody)
        if b.kind != "snapshot":
            raise TinkerError(400, f"save_weights_for_sampler kind {b.kind!r} is not supported; only 'snapshot'")
        return _future_json(service.save_for_sampler(b.model_id, b.path), b.model_id)

    @app.post(f"{PREFIX}/create_sampling_session")
    async def create_sampling_session(request: Request):
        b = await json_body(request, CreateSamplingBody)
        sid = service.create_sampling_session(b.session_id, b.model_path, b.base_model)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get(f"{PREFIX}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str):
        s = service.sampler(sampler_id)
        return {"sampler_id": s.sampling_session_id, "base_model": s.base_model, "model_path": s.model_path}

    @app.post(f"{PREFIX}/asample")
    async def asample(request: Request):
        from rl.tinker.sampling import plan, runner

        b = await json_body(request, SampleBody)
        if b.sampling_session_id is None:
            raise TinkerError(400, "asample needs a sampling_session_id (create_sampling_client first)")
        s = service.sampler(b.sampling_session_id)
        p = plan(b, service.vocab_size(), service.max_model_len, limits.max_samples)
        f = service.sample(s, runner(p))
        return _future_json(f, sample_sequence_ids=[f"{f.request_id}:{i}" for i in range(p.num_samples)])

    @app.post(f"{PREFIX}/retrieve_future")
    async def retrieve_future(request: Request):
        b = await json_body(request, RetrieveBody)
        f = service.futures.get(b.request_id)
        if f is None:
            raise TinkerError(404, f"unknown request_id {b.request_id!r}")
        await f.wait(limits.long_poll_s)  # a long poll that holds no thread
        if not f.done.is_set():
            return {"type": "try_again", "request_id": f.request_id, "queue_state": "active"}
        if f.error is not None:
            return {"error": f.error[0], "category": f.error[1]}
        if f.proto:
            return Response(content=f.result, media_type=PROTO)
        return f.result

    return app


# ----------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `jointrl tinker serve`."""
    d = TinkerLimits()
    p.add_argument("model", metavar="MODEL", help="a shipped model config, a pullable model name (`jointrl models list`) "
                                                  "or a checkpoint directory: the base model clients train and sample")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs an API key")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--api-key", default=None, help="require this key (X-API-Key; the SDK wants a 'tml-' prefix) on every "
                                                   "route but healthz; default $JOINTRL_API_KEY")
    p.add_argument("--state-dir", default=None, help="where save_state writes checkpoints (default: the cache, tinker/<port>)")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest datum / prompt + completion in tokens")
    p.add_argument("--max-training-clients", type=int, default=d.max_training_clients)
    p.add_argument("--queue-depth", type=int, default=d.queue_depth, help="queued requests per training client (and sampling)")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="model-input tokens per forward_backward request")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="the sampling engine's KV cache")
    p.add_argument("--no-sampling", action="store_true", help="start no vLLM engine (training only)")


def main_from_args(ns: argparse.Namespace) -> int:
    """`jointrl tinker serve ...` with parsed flags."""
    from rl.log import setup_logging
    from rl.paths import setup_cache_env
    from rl.serve.settings import API_KEY_ENV, LOOPBACK_HOSTS, ServeError, ServeSettings, check_api_key

    setup_logging()
    setup_cache_env()
    try:
        key = check_api_key(ns.api_key if ns.api_key is not None else os.environ.get(API_KEY_ENV), "--api-key")
    except ServeError as e:
        print(f"jointrl tinker serve: {e}", file=sys.stderr)
        return 2
    if ns.host not in LOOPBACK_HOSTS and not key:
        print(f"jointrl tinker serve: --host {ns.host}: binding a non-loopback address needs an API key (--api-key or "
              f"${API_KEY_ENV})", file=sys.stderr)
        return 2
    for flag, v in (("--max-training-clients", ns.max_training_clients), ("--queue-depth", ns.queue_depth),
                    ("--max-batch-tokens", ns.max_batch_tokens), ("--max-model-len", ns.max_model_len)):
        if v < 1:
            print(f"jointrl tinker serve: {flag} must be >= 1, got {v}", file=sys.stderr)
            return 2
    from rl.serve.app import prepare_model  # the model resolver `jointrl serve` and `jointrl train` share

    try:
        prepared = prepare_model(ns.model, ServeSettings())
    except ServeError as e:
        print(f"jointrl tinker serve: {e}", file=sys.stderr)
        return 2
    from jointrl.paths import cache_root

    state = Path(ns.state_dir) if ns.state_dir else cache_root() / "tinker" / str(ns.port)
    limits = TinkerLimits(max_training_clients=ns.max_training_clients, queue_depth=ns.queue_depth,
                          max_batch_tokens=ns.max_batch_tokens)
    tokenizer = None
    if not (prepared.path / "tokenizer.json").is_file():  # a shipped config's random checkpoint: the project's tokenizer
        from model import chat

        tokenizer = str(chat.TOKENIZER_DIR)
    service = build_service(str(prepared.path), ns.model, state, limits, ns.max_model_len,
                            None if ns.no_sampling else ns.kv_cache_gib, prepared.dtype, tokenizer)
    from rl.http_run import run_until_stopped

    app = create_app(service, key)
    log.info("tinker service for %s on http://%s:%d (auth %s)", ns.model, ns.host, ns.port, "on" if key else "off")
    print(f"jointrl tinker serve: listening on http://{ns.host}:{ns.port} (TINKER_BASE_URL)", file=sys.stderr, flush=True)
    try:
        run_until_stopped(app, ns.host, ns.port, log_level="warning", access_log=False)
    finally:
        service.shutdown()
    return 0


def build_service(model_dir: str, served_name: str, state_dir: Path, limits: TinkerLimits, max_model_len: int,
                  kv_cache_gib: float | None, dtype: str = "float32", tokenizer: str | None = None) -> TinkerService:
    def engine():
        from rl.rollout.engine import EngineConfig, RolloutEngine

        return RolloutEngine(EngineConfig(model_path=model_dir, dtype=dtype, max_model_len=max_model_len, tokenizer=tokenizer,
                                          kv_cache_gib=kv_cache_gib or 1.0, reasoning_start=None, reasoning_end=None))

    return TinkerService(model_dir, served_name, state_dir, limits, None if kv_cache_gib is None else engine, max_model_len,
                         tokenizer_dir=tokenizer or model_dir)


def main(argv: list[str] | None = None) -> int:
    """`jointrl tinker SUBCOMMAND ...` (and `python -m rl.tinker`): only `serve` exists."""
    parser = argparse.ArgumentParser(prog="jointrl tinker", description="a Tinker-compatible training service (docs/tinker.md)")
    sub = parser.add_subparsers(dest="sub", metavar="{serve}")
    add_arguments(sub.add_parser("serve", help="serve MODEL over the Tinker REST protocol"))
    args = parser.parse_args(argv)
    if args.sub != "serve":
        parser.print_help(sys.stderr)
        return 2
    return main_from_args(args)
