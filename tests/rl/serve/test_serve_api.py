"""Both wire protocols over one real in-process engine: the Anthropic client, true streaming, disconnect aborts, auth, limits, metrics, fuzzing.

One `StreamingEngine` (the tiny Qwen3-MoE test checkpoint, fp32) is shared by three apps, each a
`ChatService` + uvicorn on its own loopback port and thread:
- `open`: no key, default limits, recording (the client-library tests, streaming, disconnects);
- `guarded`: an API key, small limits and a one-slot admission queue (auth, 413/400/429);
- `fuzz`: no key, max_tokens capped at 4 (schemathesis generates requests that really run).
Random weights ramble, so assertions are about structure, budgets and token-level records.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Literal  # module level: the Agents SDK resolves a tool's (string) annotations here

import anthropic
import httpx
import openai
import pytest

from jointrl.records import Message
from model import chat
from rl.serve import ChatService, ServeSettings, build_service, create_app, read_records
from rl.serve.anthropic import parse_messages_request
from tests.helpers.checkpoints import build_test_checkpoint
from tests.rl.serve.serve_fixture import free_port

pytestmark = pytest.mark.slow

KEY = "test-key-123"
NAME = "ultra-moe-model"
TOOLS = [{"name": "get_cpu_usage", "description": "Read CPU utilisation from the monitoring API",
          "input_schema": {"type": "object", "properties": {"window": {"type": "string"}}}}]


@dataclass
class App:
    base: str
    service: ChatService
    server: object


def _start(service: ChatService, api_key: str | None = None) -> App:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service, api_key), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    return App(f"http://127.0.0.1:{port}", service, server)


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_api")
    ckpt = build_test_checkpoint(tmp / "ckpt")
    settings = ServeSettings(max_model_len=1024, served_names=(NAME, "sparse-moe-2.8t"))
    main = build_service(str(ckpt), settings, record_dir=str(tmp / "records"))

    def sibling(**kw) -> ChatService:
        s = replace(settings, **kw)
        return ChatService(main.engine, main.codec, s, main.model_names, s.max_model_len)

    out = {
        "open": _start(main),
        "guarded": _start(sibling(max_body_bytes=4096, max_messages=4, max_tokens_limit=600, max_running=1, max_queue=1), KEY),
        "fuzz": _start(sibling(max_tokens_limit=4)),
        "records": tmp / "records",
    }
    # Warm-up: the engine's first steps compile kernels (seconds); timing tests must not pay for them.
    httpx.post(f"{out['fuzz'].base}/v1/chat/completions", timeout=120,
               json={"messages": [{"role": "user", "content": "warm up"}], "thinking_budget": 2, "stream": True})
    yield out
    for k in ("open", "guarded", "fuzz"):
        out[k].server.should_exit = True
    time.sleep(0.5)
    main.engine.shutdown()


def _record(apps, rid):
    return {r.id: r for r in read_records(apps["records"])}[rid]


def _health(app: App) -> dict:
    return httpx.get(f"{app.base}/health", timeout=10).json()


# ----------------------------------------------------------------------------- Anthropic client, three tiers
def _conversation(thinking_text: str):
    """The seeds' conversation in Messages form: user, assistant (thinking + tool_use), tool_result + follow-up."""
    return [
        {"role": "user", "content": "Check recent CPU utilization logs and generate optimization suggestions"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": thinking_text, "signature": "abc"},
            {"type": "text", "text": "Let me read the monitoring data."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_cpu_usage", "input": {"window": "1h"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Average CPU utilization reached 85%"},
            {"type": "text", "text": "Based on the above logs, provide a code-level optimization plan"}]},
    ]


@pytest.mark.parametrize("budget_tokens,tier", [(64, "low"), (300, "high"), (4096, "max")])
def test_anthropic_client_multi_turn_with_thinking_and_tools(apps, budget_tokens, tier):
    app = apps["open"]
    client = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=120)
    budgets = app.service.settings.thinking_budgets
    messages = _conversation(f"Need CPU data ({tier}).")
    for stream in (False, True):
        kw = dict(model=NAME, max_tokens=24, system="You are a careful SRE.", tools=TOOLS, messages=messages,
                  thinking={"type": "enabled", "budget_tokens": budget_tokens})
        if stream:
            with client.messages.stream(**kw) as s:
                kinds = [ev.type for ev in s]
                msg = s.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert "content_block_start" in kinds and "message_delta" in kinds
        else:
            msg = client.messages.create(**kw)
        rec = _record(apps, msg.id)
        assert rec.request["protocol"] == "anthropic" and rec.request["messages"] == messages
        assert rec.request["thinking_tier"] == tier
        assert rec.request["thinking_budget_tokens"] == (None if budgets[tier] < 0 else budgets[tier])
        # the prompt is the chat format's rendering of the translated history, thinking included
        req = parse_messages_request({**kw, "tools": TOOLS}, app.service.settings, app.service.model_names, app.service.codec)
        assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool", "user"]
        want = app.service.tokenizer.encode(chat.render(req.messages, list(req.tools), add_generation_prompt=True),
                                            add_special_tokens=False)
        assert list(rec.prompt_token_ids) == want
        assert f"Need CPU data ({tier}).\n</think>" in chat.render(req.messages, list(req.tools))
        rc = rec.choices[0]
        assert msg.usage.input_tokens == len(want) and msg.usage.output_tokens == len(rc.completion_token_ids) <= 24
        parsed = chat.parse_assistant(rc.text, turn=1)
        thinking = [b for b in msg.content if b.type == "thinking"]
        texts = [b for b in msg.content if b.type == "text"]
        assert (thinking[0].thinking if thinking else None) == parsed.message.reasoning
        assert all(b.signature for b in thinking)
        assert "".join(b.text for b in texts) == parsed.message.content
        assert msg.stop_reason == {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}[rc.finish_reason]
        # next turn: the reply goes back as returned (thinking retained), plus a user turn
        follow = messages + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                             {"role": "user", "content": "Summarise the plan."}]
        msg2 = client.messages.create(**{**kw, "messages": follow, "max_tokens": 4})
        rec2 = _record(apps, msg2.id)
        prompt2 = app.service.tokenizer.decode(list(rec2.prompt_token_ids), skip_special_tokens=False)
        if parsed.message.reasoning:  # (history is client text: a structure token the model wrote comes back defused)
            assert app.service.codec.defuse(parsed.message.reasoning) in prompt2
        assert len(rec2.prompt_token_ids) > len(rec.prompt_token_ids)


def test_anthropic_thinking_budget_extension_and_count_tokens(apps):
    app = apps["open"]
    client = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    low = app.service.settings.thinking_budgets["low"]
    msg = client.messages.create(model="sparse-moe-2.8t", max_tokens=low + 16, messages=msgs, extra_body={"thinking_budget": "low"})
    rec = _record(apps, msg.id)
    assert (rec.request["thinking_tier"], rec.request["thinking_budget_tokens"]) == ("low", low)
    ids = list(rec.choices[0].completion_token_ids)
    # thinking ends at the budget at the latest (a random model may also end its turn inside thinking)
    n_think = ids.index(chat.THINK_END_ID) if chat.THINK_END_ID in ids else len(ids)
    assert n_think <= low and (chat.THINK_END_ID in ids or ids[-1] in chat.STOP_TOKEN_IDS)
    assert msg.usage.output_tokens_details.thinking_tokens == n_think
    n = client.messages.count_tokens(model=NAME, messages=msgs)
    assert n.input_tokens == len(app.service.tokenizer.encode(chat.render([Message(role="user", content="What is 2 + 2?")],
                                                                          add_generation_prompt=True), add_special_tokens=False))


def test_anthropic_errors_use_its_shape(apps):
    url = f"{apps['open'].base}/v1/messages"
    ok = [{"role": "user", "content": "hi"}]
    cases = [
        (b'{"model": ', 400), ({"model": NAME, "messages": ok}, 400), ({"model": NAME, "max_tokens": 4, "messages": [{"role": "bot", "content": "x"}]}, 400),
        ({"model": "claude-9", "max_tokens": 4, "messages": ok}, 404),
        ({"model": NAME, "max_tokens": 4, "messages": ok, "thinking": {"type": "enabled", "budget_tokens": "lots"}}, 400),
        ({"model": NAME, "max_tokens": 4, "messages": ok + [{"role": "assistant", "content": "prefill"}]}, 400),
    ]
    for payload, status in cases:
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (payload, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "not_found_error") and body["error"]["message"]
    client = anthropic.Anthropic(base_url=apps["open"].base, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=ok)


def test_images_are_refused_with_the_reason(apps):
    base = apps["open"].base
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    r = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_input_unsupported"
    assert "image input is not supported" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/messages", timeout=30, json={"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]})
    assert r.status_code == 400 and "image input is not supported" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- true streaming and aborts
def test_openai_stream_first_chunk_arrives_long_before_the_last(apps):
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Write a long essay."}], max_tokens=400,
                                            seed=7, stream=True, extra_body={"thinking_budget": 8})
    times, text = [], []
    for chunk in stream:
        for c in chunk.choices:
            piece = (c.delta.content or "") + ((c.delta.model_extra or {}).get("reasoning_content") or "")
            if piece:
                times.append(time.perf_counter() - t0)
                text.append(piece)
    first, last = times[0], times[-1]
    print(f"\nopenai stream: first text chunk {first * 1000:.0f} ms, last {last * 1000:.0f} ms, {len(times)} text chunks")
    assert len(times) > 20
    assert first < 0.2 * last, (first, last)


def _wait_engine_idle(app: App, limit_s: float) -> float:
    t0 = time.perf_counter()
    while True:
        h = _health(app)
        if h["engine_running"] == 0 and h["engine_waiting"] == 0 and h["inflight"] == 0:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > limit_s:
            pytest.fail(f"engine still busy {limit_s}s after the disconnect: {h}")
        time.sleep(0.02)


@pytest.mark.parametrize("route", ["openai", "anthropic", "openai-plain"])
def test_client_disconnect_aborts_the_engine_request(apps, route):
    app = apps["open"]
    kv_before = _health(app)["kv_cache_usage"]
    msgs = [{"role": "user", "content": "Tell me everything."}]
    if route == "anthropic":
        url, body = "/v1/messages", {"model": NAME, "max_tokens": 900, "messages": msgs, "stream": True, "temperature": 0}
    else:  # greedy: this prompt then runs to max_tokens (a sampled reply might end early)
        url, body = "/v1/chat/completions", {"model": NAME, "max_tokens": 900, "messages": msgs, "stream": route == "openai",
                                             "temperature": 0}
    if route == "openai-plain":  # not streamed: the client gives up while the reply is being generated
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(app.base + url, json=body, timeout=httpx.Timeout(30, read=1.0))
        t_close = time.perf_counter()
    else:
        with httpx.Client(timeout=60) as c, c.stream("POST", app.base + url, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (leaving a for loop over it early would already close the connection)
            assert [next(lines) for _ in range(12)][0].startswith(("data: ", "event: "))
            h = _health(app)
            assert h["engine_running"] == 1 and h["inflight"] == 1, h
        t_close = time.perf_counter()
    waited = _wait_engine_idle(app, 1.0)
    print(f"\n{route}: engine running count back to 0 {(time.perf_counter() - t_close) * 1000:.0f} ms after the disconnect")
    assert waited <= 1.0
    assert _health(app)["kv_cache_usage"] <= kv_before + 1e-9  # its KV blocks were freed


# ----------------------------------------------------------------------------- auth, limits, metrics
def test_every_route_needs_the_key(apps):
    base = apps["guarded"].base
    for headers in ({}, {"x-api-key": ""}, {"x-api-key": "wrong"}):  # probes need no key, and learn nothing without one
        r = httpx.get(base + "/health", headers=headers, timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert "kv_cache_usage" in httpx.get(base + "/health", headers={"x-api-key": KEY}, timeout=10).json()
    routes = [("GET", "/metrics"), ("GET", "/v1/models"), ("GET", f"/v1/models/{NAME}"), ("GET", "/openapi.json"),
              ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
              ("GET", "/nope")]
    count = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"x-api-key": ""}, {"Authorization": "Bearer"}):
            r = httpx.request(method, base + path, headers=headers, json=count if method == "POST" else None, timeout=30)
            assert r.status_code == 401, (path, headers, r.status_code)
            body = r.json()
            assert (body["error"]["type"] == "authentication_error") and body["error"]["message"]
            if path.startswith("/v1/messages"):
                assert body["type"] == "error"
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            path2 = "/v1/messages/count_tokens" if method == "POST" else path
            r = httpx.request(method, base + path2, headers=headers, json=count if method == "POST" else None, timeout=30)
            assert r.status_code == (404 if path == "/nope" else 200), (path2, r.text)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.count_tokens(model=NAME, messages=count["messages"])
    assert openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0).models.list().data[0].id == NAME


def test_limits_413_400_and_full_queue_429(apps):
    app = apps["guarded"]
    h = {"x-api-key": KEY}
    big = {"model": NAME, "messages": [{"role": "user", "content": "x" * 5000}]}
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = httpx.post(app.base + path, json={**big, "max_tokens": 4}, headers=h, timeout=30)
        assert r.status_code == 413 and "max-body-bytes" in r.text
    many = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2 + [{"role": "user", "content": "c"}]
    r = httpx.post(app.base + "/v1/chat/completions", json={"model": NAME, "messages": many}, headers=h, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
    r = httpx.post(app.base + "/v1/messages", json={"model": NAME, "max_tokens": 601, "messages": [{"role": "user", "content": "a"}]},
                   headers=h, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error" and "601" in r.json()["error"]["message"]

    async def scenario():
        body = {"model": NAME, "max_tokens": 600, "stream": True, "temperature": 0, "messages": [{"role": "user", "content": "go on"}]}
        async with httpx.AsyncClient(base_url=app.base, headers=h, timeout=60) as c:
            running = await c.send(c.build_request("POST", "/v1/chat/completions", json=body), stream=True)
            assert running.status_code == 200
            queued = asyncio.ensure_future(c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}))
            for _ in range(100):
                if app.service.admission.waiting == 1:
                    break
                await asyncio.sleep(0.02)
            assert app.service.admission.waiting == 1
            full = await c.post("/v1/chat/completions", json=body)
            assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["type"] == "rate_limit_error"
            full_a = await c.post("/v1/messages", json=body)
            assert full_a.status_code == 429 and full_a.json()["error"]["type"] == "rate_limit_error"
            await running.aclose()  # the running request is aborted; the queued one gets its slot and finishes
            done = await queued
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] <= 2
    asyncio.run(scenario())
    assert app.service.admission.running == 0 and app.service.admission.waiting == 0


def test_metrics_in_prometheus_text_format(apps):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{apps['open'].base}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    reqs = {(s.labels["route"], s.labels["status"]): s.value for s in fams["jointrl_serve_requests"].samples if s.name.endswith("_total")}
    assert reqs[("/v1/messages", "200")] >= 6 and reqs[("/v1/chat/completions", "400")] >= 1
    assert sum(s.value for s in fams["jointrl_serve_generated_tokens"].samples if s.name.endswith("_total")) > 100
    lat = {s.labels.get("route"): s.value for s in fams["jointrl_serve_request_latency_seconds"].samples if s.name.endswith("_count")}
    assert lat["/v1/messages"] >= 6
    assert "jointrl_serve_time_to_first_token_seconds" in fams and "jointrl_serve_queue_depth" in fams
    assert "jointrl_serve_generated_tokens_per_second" in fams and "jointrl_serve_engine_running" in fams
    aborted = [s.value for s in fams["jointrl_serve_aborted"].samples if s.name.endswith("_total")]
    assert aborted and aborted[0] >= 3  # the disconnect tests


# ----------------------------------------------------------------------------- fuzzing from the OpenAPI schema
def test_fuzz_routes_from_the_openapi_schema(apps):
    import hypothesis
    import schemathesis
    from schemathesis import GenerationMode

    base = apps["fuzz"].base
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {(o.method.upper(), o.path) for o in ops} >= {("POST", "/v1/chat/completions"), ("POST", "/v1/messages"),
                                                         ("POST", "/v1/messages/count_tokens"), ("GET", "/v1/models")}
    failures, calls = [], [0]
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):  # schema-valid bodies, then schema-violating ones
            @hypothesis.settings(max_examples=8, deadline=None, database=None, derandomize=True,
                                 suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
            @hypothesis.given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                calls[0] += 1
                resp = case.call(base_url=base, timeout=20)  # a hang fails as a timeout
                if resp.status_code >= 500:
                    failures.append((op.method, op.path, mode.value, resp.status_code, resp.text[:300]))

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # nothing to break in this operation's schema (e.g. no body)
                assert mode == GenerationMode.NEGATIVE, op.path
    print(f"\nschemathesis: {calls[0]} generated requests over {len(ops)} operations")
    assert not failures, failures[:5]
    assert calls[0] >= 30


# ----------------------------------------------------------------------------- hostile clients against the real engine
def test_a_seed_out_of_range_is_refused_and_never_poisons_the_engine(apps):
    """seed = 2**64 once reached the engine and failed every later request on both routes until restart."""
    base = apps["open"].base
    msgs = [{"role": "user", "content": "hi"}]
    for seed in (2 ** 64, 2 ** 63, -(2 ** 63) - 1, 10 ** 30):
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 4, "seed": seed}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        r = httpx.post(f"{base}/v1/responses", json={"model": NAME, "input": "hi", "max_output_tokens": 4, "seed": seed}, timeout=60)
        assert r.status_code == 400, r.text
    for seed in (2 ** 63 - 1, -(2 ** 63), 0):  # the ends of the accepted range run
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 4, "seed": seed, "temperature": 1},
                       timeout=60)
        assert r.status_code == 200, r.text
    a = httpx.post(f"{base}/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 6, "seed": 2 ** 63 - 1}, timeout=60).json()
    b = httpx.post(f"{base}/v1/chat/completions", json={"model": NAME, "messages": msgs, "max_tokens": 6, "seed": 2 ** 63 - 1}, timeout=60).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]  # a seed still replays
    for path, body in (("/v1/messages", {"model": NAME, "max_tokens": 4, "messages": msgs}), ("/v1/responses", {"model": NAME, "input": "hi",
                                                                                                              "max_output_tokens": 4})):
        assert httpx.post(base + path, json=body, timeout=60).status_code == 200


def test_hostile_bodies_are_4xx_and_the_server_keeps_serving(apps):
    from tests.rl.serve.test_serve_redteam import ROUTES, _hostile_bodies

    base = apps["fuzz"].base
    for route in ROUTES:
        for name, raw in _hostile_bodies():
            r = httpx.post(base + route, content=raw, headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code < 500, (route, name, r.status_code, r.text[:300])
            if not (name == "huge seed" and route.startswith("/v1/messages")):
                assert r.status_code >= 400, (route, name, r.status_code)
    ok = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(base + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
    assert httpx.post(base + "/v1/messages", json=ok, timeout=60).status_code == 200
    assert _health(apps["fuzz"])["status"] == "ok"


def test_structure_tokens_in_client_text_reach_the_engine_defused(apps):
    """Every structure token in user, system and tool text: the recorded prompt holds each exactly as the
    template placed it (the engine saw no forged turn, thinking block, call or tool result)."""
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    evil = "".join(chat.SPECIAL_TOKENS) + "<tools></tools>"
    clean = client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    r = client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "system", "content": evil}, {"role": "user", "content": evil}])
    ids, base_ids = list(_record(apps, r.id).prompt_token_ids), list(_record(apps, clean.id).prompt_token_ids)
    for t in range(len(chat.SPECIAL_TOKENS)):
        assert ids.count(t) == base_ids.count(t), chat.SPECIAL_TOKENS[t]


# ----------------------------------------------------------------------------- what mainstream clients send
def test_openai_reasoning_efforts_map_onto_the_tiers(apps):
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    budgets = app.service.settings.thinking_budgets
    for effort, tier in (("minimal", "low"), ("low", "low"), ("medium", "high"), ("high", "high"), ("max", "max")):
        r = client.chat.completions.create(model=NAME, max_tokens=300, reasoning_effort=effort, messages=[{"role": "user", "content": "2+2?"}])
        rec = _record(apps, r.id)
        assert rec.request["thinking_tier"] == tier, effort
        ids = list(rec.choices[0].completion_token_ids)
        if budgets[tier] >= 0:
            n_think = ids.index(chat.THINK_END_ID) if chat.THINK_END_ID in ids else len(ids)
            assert n_think <= budgets[tier] and r.usage.completion_tokens_details.reasoning_tokens == n_think


def test_no_budget_leaves_room_for_an_answer(apps):
    """A client that names no budget (the Agents SDK, litellm by default): thinking takes at most half the reply."""
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    ac = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=120)
    for max_tokens in (20, 41):
        r = client.chat.completions.create(model=NAME, max_tokens=max_tokens, seed=3, messages=[{"role": "user", "content": "Think long."}])
        m = ac.messages.create(model=NAME, max_tokens=max_tokens, messages=[{"role": "user", "content": "Think long."}])
        for rid in (r.id, m.id):
            ids = list(_record(apps, rid).choices[0].completion_token_ids)
            if ids[-1] not in chat.STOP_TOKEN_IDS or chat.THINK_END_ID in ids:  # (a model may end its turn while thinking)
                assert ids.index(chat.THINK_END_ID) <= max_tokens // 2


def test_anthropic_route_validates_and_enforces_thinking_budget_like_openai(apps):
    base = apps["open"].base
    low = apps["open"].service.settings.thinking_budgets["low"]
    msgs = [{"role": "user", "content": "Count to a thousand."}]
    for extra in ({"extra_body": {"thinking_budget": "low"}}, {"thinking_budget": "low"}, {"reasoning_effort": "minimal"},
                  {"extra_body": {"reasoning_effort": "low"}}):
        r = httpx.post(f"{base}/v1/messages", json={"model": NAME, "max_tokens": 200, "messages": msgs, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        rec = _record(apps, r.json()["id"])
        ids = list(rec.choices[0].completion_token_ids)
        assert rec.request["thinking_budget_tokens"] == low
        assert (ids.index(chat.THINK_END_ID) if chat.THINK_END_ID in ids else len(ids)) <= low, extra
    for extra in ({"extra_body": {"thinking_budget": "extreme"}}, {"extra_body": "low"}, {"extra_body": [1]}, {"thinking_budget": -1},
                  {"thinking_budget": 2 ** 40}, {"reasoning_effort": "loads"}):
        for path in ("/v1/messages", "/v1/chat/completions"):
            r = httpx.post(base + path, json={"model": NAME, "max_tokens": 5, "messages": msgs, **extra}, timeout=60)
            assert r.status_code == 400, (path, extra, r.text)


def test_top_logprobs_are_the_engines_alternatives(apps):
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=NAME, max_tokens=12, logprobs=True, top_logprobs=20, temperature=1, seed=5,
                                       messages=[{"role": "user", "content": "hi"}])
    rec = _record(apps, r.id)
    content = r.choices[0].logprobs.content
    assert len(content) == len(rec.choices[0].completion_token_ids)
    for entry, lp in zip(content, rec.choices[0].logprobs):
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 20 and tops == sorted(tops, reverse=True)
        assert abs(entry.logprob - lp) < 1e-6 and entry.logprob <= tops[0] + 1e-6
        assert sum(math.exp(x) for x in tops) <= 1 + 1e-4
        if entry.token in [t.token for t in entry.top_logprobs]:  # the sampled token's own entry agrees
            assert abs(next(t.logprob for t in entry.top_logprobs if t.token == entry.token) - entry.logprob) < 1e-5
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, max_tokens=2, logprobs=True, top_logprobs=21, messages=[{"role": "user", "content": "hi"}])


TWO_TOOLS = [{"type": "function", "function": {"name": "get_cpu_usage", "parameters": {"type": "object", "properties": {"window": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "restart_service", "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}}]


def test_required_and_named_tool_choice_only_call_the_requests_tools(apps):
    """Random weights would name anything ("PARIS"); vLLM's structured outputs keep the name to the request's tools
    and the arguments to a JSON object, on every route."""
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    names = {t["function"]["name"] for t in TWO_TOOLS}
    seen = set()
    for seed in range(6):
        r = client.chat.completions.create(model=NAME, max_tokens=120, seed=seed, temperature=1, tools=TWO_TOOLS, tool_choice="required",
                                           reasoning_effort="low", messages=[{"role": "user", "content": "Check the CPU."}])
        c = r.choices[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        assert call.function.name in names and isinstance(json.loads(call.function.arguments), dict)
        seen.add(call.function.name)
        rec = _record(apps, r.id).choices[0]
        assert 0 in rec.loss_mask and rec.completion_token_ids[-1] == chat.IM_END_ID
    assert seen, "no run left room for a call"
    r = client.chat.completions.create(model=NAME, max_tokens=120, seed=1, tools=TWO_TOOLS, reasoning_effort="low",
                                       tool_choice={"type": "function", "function": {"name": "restart_service"}},
                                       messages=[{"role": "user", "content": "Restart it."}])
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["restart_service"]
    ac = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=120)
    m = ac.messages.create(model=NAME, max_tokens=120, tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                                              for t in TWO_TOOLS], tool_choice={"type": "any"}, extra_body={"thinking_budget": "low"},
                           messages=[{"role": "user", "content": "Check the CPU."}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "max_tokens" or (uses and all(b.name in names for b in uses))


# ----------------------------------------------------------------------------- the Responses API
RESP_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TWO_TOOLS]


def test_responses_api_with_tools_reasoning_and_previous_response_id(apps):
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    for seed in range(4):  # random weights may fill the reply inside the call's arguments: another seed then
        r1 = client.responses.create(model=NAME, input="Check the CPU.", instructions="You are an SRE.", tools=RESP_TOOLS, tool_choice="required",
                                     reasoning={"effort": "low"}, max_output_tokens=400, temperature=1, extra_body={"seed": seed})
        if r1.status == "completed":
            break
    assert r1.status == "completed" and r1.id.startswith("resp_")
    kinds = [o.type for o in r1.output]
    assert kinds[-1] == "function_call" and kinds[0] in ("reasoning", "function_call")
    call = r1.output[-1]
    assert call.name in {t["name"] for t in RESP_TOOLS} and isinstance(json.loads(call.arguments), dict)
    rec1 = _record(apps, r1.id)
    assert rec1.request["protocol"] == "responses" and rec1.request["thinking_tier"] == "low"
    assert r1.usage.output_tokens == len(rec1.choices[0].completion_token_ids) and r1.usage.input_tokens == len(rec1.prompt_token_ids)
    # next turn by previous_response_id: the reply (reasoning included) is the next prompt's history, its ids reused
    r2 = client.responses.create(model=NAME, previous_response_id=r1.id, tools=RESP_TOOLS, max_output_tokens=8, reasoning={"effort": "low"},
                                 instructions="You are an SRE.",  # instructions are not carried over (as in OpenAI's API)
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "CPU at 85%"}])
    rec2 = _record(apps, r2.id)
    prompt2 = app.service.tokenizer.decode(list(rec2.prompt_token_ids), skip_special_tokens=False)
    reasoning = [o for o in r1.output if o.type == "reasoning"]
    assert all(o.content[0].text in prompt2 for o in reasoning) and call.arguments in prompt2 and "CPU at 85%" in prompt2
    assert prompt2.startswith(app.service.tokenizer.decode(list(rec1.prompt_token_ids), skip_special_tokens=False))
    if rec2.continues is not None:  # the reply rendered back to its own text: its sampled ids were reused
        assert rec2.continues == (r1.id, 0)
        assert list(rec2.prompt_token_ids[: rec2.prompt_reused_tokens]) == list(rec1.prompt_token_ids) + list(rec1.choices[0].completion_token_ids)
    # the same turn with the items sent back instead (stateless clients): same prompt, reasoning kept
    items = [{"role": "system", "content": "You are an SRE."}, {"role": "user", "content": "Check the CPU."}] + \
        [o.model_dump(exclude_none=True) for o in r1.output] + [{"type": "function_call_output", "call_id": call.call_id, "output": "CPU at 85%"}]
    r3 = client.responses.create(model=NAME, input=items, tools=RESP_TOOLS, max_output_tokens=8, reasoning={"effort": "low"}, store=False)
    assert list(_record(apps, r3.id).prompt_token_ids) == list(rec2.prompt_token_ids)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, previous_response_id=r3.id, input="more", max_output_tokens=4)  # store: false
    # reasoning sent back only as encrypted_content (a client that keeps no content)
    r4 = client.responses.create(model=NAME, input="Check the CPU.", instructions="You are an SRE.", tools=RESP_TOOLS, tool_choice="required",
                                 reasoning={"effort": "low"}, max_output_tokens=400, include=["reasoning.encrypted_content"],
                                 extra_body={"seed": 11})
    back = [{k: v for k, v in o.model_dump(exclude_none=True).items() if k != "content"} for o in r4.output]
    if r4.output[0].type == "reasoning" and r4.output[-1].type == "function_call":
        assert back[0]["encrypted_content"]
        r5 = client.responses.create(model=NAME, input=[{"role": "user", "content": "Check the CPU."}] + back +
                                     [{"type": "function_call_output", "call_id": r4.output[-1].call_id, "output": "ok"}],
                                     instructions="You are an SRE.", tools=RESP_TOOLS, max_output_tokens=4, reasoning={"effort": "low"})
        prompt = app.service.tokenizer.decode(list(_record(apps, r5.id).prompt_token_ids), skip_special_tokens=False)
        assert r4.output[0].content[0].text in prompt


def test_responses_api_streams_the_same_reply(apps):
    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    kinds, text, thought = [], [], []
    for ev in client.responses.create(model=NAME, input="Tell me a story.", max_output_tokens=60, reasoning={"effort": "minimal"}, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
        if ev.type == "response.reasoning_text.delta":
            thought.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [o.id for o in final.output] == [ev_id for ev_id in dict.fromkeys(o.id for o in final.output)]
    msg = [o for o in final.output if o.type == "message"]
    assert "".join(text) == (msg[0].content[0].text if msg else "")
    reasoning = [o for o in final.output if o.type == "reasoning"]
    assert "".join(thought) == (reasoning[0].content[0].text if reasoning else "")
    rec = _record(apps, final.id)
    parsed = chat.parse_assistant(rec.choices[0].text, turn=0).message
    assert (parsed.reasoning or "") == "".join(thought) and parsed.content == "".join(text)
    assert final.status == ("incomplete" if rec.choices[0].finish_reason == "length" else "completed")
    # the SDK's stream helper (which needs response.completed) on a reply that completes: a required call closes the turn
    for seed in range(4):
        try:
            with client.responses.stream(model=NAME, input="Check the CPU.", tools=RESP_TOOLS, tool_choice="required", max_output_tokens=400,
                                         reasoning={"effort": "low"}, extra_body={"seed": seed}) as s:
                for _ in s:
                    pass
                done = s.get_final_response()
            break
        except RuntimeError:  # response.incomplete: the arguments ran to the limit; another seed
            continue
    assert done.status == "completed" and done.output[-1].type == "function_call"
    assert done.output[-1].name in {t["name"] for t in RESP_TOOLS}


def test_litellm_and_langchain_speak_to_both_routes(apps, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: the cost map shipped in the wheel
    litellm = pytest.importorskip("litellm")
    langchain_openai = pytest.importorskip("langchain_openai")
    base = apps["open"].base
    r = litellm.completion(model=f"openai/{NAME}", api_base=f"{base}/v1", api_key="unused", max_tokens=30, reasoning_effort="medium",
                           messages=[{"role": "user", "content": "hi"}])
    assert _record(apps, r.id).request["thinking_tier"] == "high"
    r = litellm.completion(model=f"openai/{NAME}", api_base=f"{base}/v1", api_key="unused", max_tokens=120, tools=TWO_TOOLS,
                           tool_choice="required", reasoning_effort="low", messages=[{"role": "user", "content": "Check the CPU."}])
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "length" or calls[0].function.name in {t["function"]["name"] for t in TWO_TOOLS}
    a = litellm.completion(model=f"anthropic/{NAME}", api_base=base, api_key="unused", max_tokens=100, allowed_openai_params=["thinking"],
                           thinking={"type": "enabled", "budget_tokens": 64}, messages=[{"role": "user", "content": "hi"}])
    newest = max((r for r in read_records(apps["records"]) if r.request["protocol"] == "anthropic"), key=lambda r: r.created)
    assert a.choices[0].message is not None and newest.request["thinking_tier"] == "low"
    llm = langchain_openai.ChatOpenAI(model=NAME, base_url=f"{base}/v1", api_key="unused", max_tokens=30, reasoning_effort="medium",
                                      max_retries=0)
    out = llm.invoke("hi")
    assert isinstance(out.content, (str, list))
    bound = llm.bind_tools([{"type": "function", "function": TWO_TOOLS[0]["function"]}], tool_choice="required")
    out = langchain_openai.ChatOpenAI(model=NAME, base_url=f"{base}/v1", api_key="unused", max_tokens=120, reasoning_effort="low",
                                      max_retries=0).bind_tools([TWO_TOOLS[0]], tool_choice="required").invoke("Check the CPU.")
    assert bound is not None and all(c["name"] == "get_cpu_usage" for c in out.tool_calls)




def test_openai_agents_sdk_runs_a_tool_loop_on_its_default_model(apps):
    """The OpenAI Agents SDK on its default model (the Responses API): a strict function tool called twice under
    Reasoning(effort="medium") (tier high), the first result sent back in the second turn; then an agent that sends
    no budget gets its call, not a reply spent on thinking. Runs end on a tool call: random weights never end a text
    reply before max_output_tokens, and the SDK raises on an incomplete response."""
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, ToolsToFinalOutputResult, function_tool
    from agents.exceptions import AgentsException
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai.types.shared import Reasoning

    app = apps["open"]
    client = openai.AsyncOpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    provider = OpenAIProvider(openai_client=client)  # the SDK's default provider, on this server
    assert isinstance(provider.get_model(NAME), OpenAIResponsesModel)
    config = RunConfig(model_provider=provider, tracing_disabled=True)
    readings: list[str] = []

    @function_tool  # strict (the SDK's default): the arguments are generated under its schema, an enum here
    def get_cpu_usage(window: Literal["1h", "24h"]) -> str:
        """Read CPU utilisation from the monitoring API over a time window."""
        readings.append(window)
        return f"Average CPU utilization over {window} reached 85%"

    def after_two_readings(ctx, results) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(is_final_output=len(readings) >= 2, final_output=results[-1].output)

    budgets = app.service.settings.thinking_budgets
    result = None
    for seed in range(4):  # random weights may fill the reply with whitespace inside the arguments: another seed then
        readings.clear()
        agent = Agent(name="sre", instructions="You are an SRE.", tools=[get_cpu_usage], model=NAME, reset_tool_choice=False,
                      tool_use_behavior=after_two_readings,
                      model_settings=ModelSettings(tool_choice="required", reasoning=Reasoning(effort="medium"), max_tokens=600,
                                                   extra_body={"seed": seed}))
        try:
            result = Runner.run_sync(agent, "Check the CPU twice.", run_config=config, max_turns=3)
            break
        except AgentsException:  # an incomplete response: the arguments ran to max_tokens
            result = None
    assert result is not None, "every seed ran a call's arguments to max_tokens"
    assert len(readings) == 2 and set(readings) <= {"1h", "24h"} and result.final_output.endswith("reached 85%")
    recs = [_record(apps, r.response_id) for r in result.raw_responses]
    assert len(recs) == 2
    for rec in recs:
        assert rec.request["protocol"] == "responses" and rec.request["thinking_tier"] == "high"  # medium -> high
        ids = list(rec.choices[0].completion_token_ids)
        assert ids.index(chat.THINK_END_ID) <= budgets["high"] and rec.choices[0].finish_reason == "tool_calls"
    prompt = app.service.tokenizer.decode(list(recs[1].prompt_token_ids), skip_special_tokens=False)
    assert f"Average CPU utilization over {readings[0]} reached 85%" in prompt  # the first result reached the model

    # no budget sent: the default tier keeps half the reply for the answer (here the call)
    @function_tool
    def report() -> str:
        """Hand in the report."""
        return "REPORTED"

    result = None
    for seed in range(4):
        plain = Agent(name="sre", instructions="You are an SRE.", tools=[report], model=NAME, tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", max_tokens=160, extra_body={"seed": seed}))
        try:
            result = Runner.run_sync(plain, "Think long about the CPU, then report.", run_config=config, max_turns=1)
            break
        except AgentsException:
            result = None
    assert result is not None and result.final_output == "REPORTED"
    rec = _record(apps, result.raw_responses[0].response_id)
    ids = list(rec.choices[0].completion_token_ids)
    assert rec.request["thinking_tier"] == app.service.settings.default_tier and budgets[rec.request["thinking_tier"]] > 80
    assert ids.index(chat.THINK_END_ID) <= 80, "thinking took more than half the reply"


def test_a_client_truncated_conversation_records_exact_segments(apps):
    """A long-horizon client (the `openai` client) that drops its history's middle turns keeping the task: the
    served episode (named by metadata.episode_id) records one segment per context, each exactly the tokens the
    engine was given and generated, as the agent loop's Episode.segments holds its compacted contexts."""
    from rl.serve import recorded_episode

    app = apps["open"]
    client = openai.OpenAI(base_url=f"{app.base}/v1", api_key="unused", max_retries=0, timeout=120)
    tool = {"type": "function", "function": {"name": "read_log", "strict": True, "description": "Read one log file.", "parameters": {
        "type": "object", "properties": {"file": {"type": "string", "enum": ["a.log", "b.log"]}}, "required": ["file"],
        "additionalProperties": False}}}
    episode = f"ep-{time.monotonic_ns()}"
    head = [{"role": "system", "content": "You are an SRE."}, {"role": "user", "content": "Read every log and sum the errors."}]

    def turn(messages: list, seed: int):
        r = client.chat.completions.create(model=NAME, messages=messages, tools=[tool], tool_choice="required", reasoning_effort="low",
                                           max_tokens=300, seed=seed, metadata={"episode_id": episode})
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        back = {"role": "assistant", "content": m.content, "reasoning_content": getattr(m, "reasoning_content", None),
                "tool_calls": [t.model_dump() for t in m.tool_calls]}
        return r, back, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3 errors"}

    history = list(head)
    ids = []
    for k in range(2):  # first context: two turns, the second extending the first
        r, back, result = turn(history, k)
        ids.append(r.id)
        history += [back, result]
    r, back, result = turn(head + [{"role": "user", "content": "Summary so far: 6 errors in 2 logs."}], 5)  # the client truncated
    ids.append(r.id)
    r, _, _ = turn(head + [{"role": "user", "content": "Summary so far: 6 errors in 2 logs."}, back, result], 6)
    ids.append(r.id)
    other = client.chat.completions.create(model=NAME, messages=head, max_tokens=4, metadata={"episode_id": episode + "-other"})
    recs = read_records(apps["records"])
    by_id = {x.id: x for x in recs}
    # The chains the records' own links make: a turn extends the previous one when the reply rendered back to the text
    # the engine generated (a trained model's thinking does; random weights' thinking lacks the format's newlines, so
    # here most turns start a chain of their own); the truncated turn extends nothing, whatever the weights.
    assert by_id[ids[2]].continues is None
    chains: list[list[str]] = []
    for rid in ids:
        cont = by_id[rid].continues
        if cont is not None and chains and chains[-1][-1] == cont[0]:
            chains[-1].append(rid)
        else:
            chains.append([rid])
    ep = recorded_episode(recs, episode)
    assert [list(s.record_ids) for s in ep.segments] == chains and other.id not in {i for s in ep.segments for i in s.record_ids}
    assert any(ids[2] == seg.record_ids[0] for seg in ep.segments)  # the truncation opened a segment
    for seg in ep.segments:  # each segment: the engine's own prompt and sampled ids, no re-render
        rec = by_id[seg.record_ids[-1]]
        n = len(rec.choices[0].completion_token_ids)
        assert seg.token_ids == rec.prompt_token_ids + rec.choices[0].completion_token_ids
        assert seg.loss_mask[-n:] == rec.choices[0].loss_mask
        assert [lp for lp, k in zip(seg.logprobs[-n:], seg.loss_mask[-n:]) if k] == [lp for lp in rec.choices[0].logprobs if lp is not None]
    # With the reward its scaffold gives, the episode is the Episode rollouts produce, and the trainer's collate takes
    # it: one row per segment, exactly the recorded tokens, trained on the sampled ones only.
    from rl.objective import AlgorithmSection
    from rl.serve import training_episode
    from rl.trainer.client import PolicyClient
    from rl.types import RolloutGroup, segments_of

    trained = training_episode(recs, episode, 1.0, domain="terminal")
    rows = segments_of(trained)
    assert [(s.token_ids, s.loss_mask, s.rollout_logprobs) for s in rows] == [(g.token_ids, g.loss_mask, g.logprobs) for g in ep.segments]
    assert trained.num_turns == len(ids) and trained.metrics["segments"] == len(ep.segments)
    policy = PolicyClient(None, AlgorithmSection(), reference="initial", run_dir=apps["records"], pad_token_id=0, domains=["terminal"])
    batch = policy.collate([RolloutGroup(task_id=episode, domain="terminal", episodes=(trained,))])
    assert batch.num_seqs == len(rows) and batch.rewards_B.tolist() == [1.0] * len(rows)
    for b, s in enumerate(rows):
        assert batch.input_ids_BT[b, :len(s.token_ids)].tolist() == list(s.token_ids)
        assert batch.loss_mask_BT[b, 1:len(s.token_ids)].tolist() == [float(m) for m in s.loss_mask[1:]]


def test_strict_tool_schemas_a_grammar_cannot_take_never_break_the_engine(apps):
    """A strict tool's schema is the client's: schemas the grammar backend refuses or chokes on still get a reply
    (the arguments then any JSON object, or a 400), never a 5xx, and the engine keeps serving."""
    base = apps["open"].base
    nasty = [{"type": "banana"}, {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}, "required": ["a"]},
             {"type": "object", "properties": {"a": {"type": "string", "minLength": 100000}}, "required": ["a"]},
             {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]},
             {"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(5000)]}}, "required": ["a"]},
             {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}]
    for schema in nasty:
        tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": NAME, "messages": [{"role": "user", "content": "call f"}], "tools": [tool], "tool_choice": "required",
            "thinking_budget": 0, "max_tokens": 24})
        assert r.status_code < 500, (schema, r.text[:300])
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                                                     "max_tokens": 4})
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{base}/v1/responses", timeout=60, json={"model": NAME, "input": "x", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": "yes"}]})
    assert bad.status_code == 400 and "strict" in bad.text
