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
import threading
import time
from dataclasses import dataclass, replace

import anthropic
import httpx
import openai
import pytest

from jointrl.records import Message
from model import chat
from rl.serve import ChatService, ServeSettings, build_service, create_app, read_records
from rl.serve.anthropic import parse_messages_request
from tests.helpers.checkpoints import build_test_checkpoint
from tests.rl.serve_fixture import free_port

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
        if parsed.message.reasoning:
            assert parsed.message.reasoning in prompt2
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
    routes = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", f"/v1/models/{NAME}"), ("GET", "/openapi.json"),
              ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("GET", "/nope")]
    count = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
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
