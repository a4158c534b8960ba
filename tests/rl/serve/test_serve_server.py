"""`jointrl serve` end to end: one real server (subprocess, in-process vLLM engine) driven by the `openai` client.

The served model is a tiny random-weight Qwen3-MoE with the shipped tokenizer
(`rl.serve.build_test_checkpoint`): fp32, fast to start, and independent of the HybridMoe vLLM
plugin (test_serve_tiny.py serves the shipped `tiny` HybridMoe config through that plugin).
Random weights ramble: thinking ends only because the budget forces `</think>`, which is what the
budget test shows. Token-level facts are read from the server's JSONL records.
"""
from __future__ import annotations

import json
import math
import threading

import httpx
import openai
import pytest

from model import chat
from rl.config import RolloutSection
from rl.rollout.codec import make_codec
from rl.serve import ServeCodec, ServeSettings, parse_chat_request
from tests.helpers.checkpoints import build_test_checkpoint
from tests.rl.serve.serve_fixture import Server, running_server

pytestmark = pytest.mark.slow

LOW = RolloutSection().thinking_budgets["low"]

TOOLS = [
    {"type": "function", "function": {"name": "get_cpu_usage", "description": "Read CPU utilisation from the monitoring API",
                                      "parameters": {"type": "object", "properties": {"window": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the internet",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]
# Shaped like the seed article's example: user -> assistant with tool_calls -> tool result -> user.
SEED_MESSAGES = [
    {"role": "user", "content": "Check recent CPU utilization logs and generate optimization suggestions"},
    {"role": "assistant", "content": "Thinking: Need to call the monitoring alert API to get CPU data.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_cpu_usage", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Average CPU utilization reached 85%"},
    {"role": "user", "content": "Based on the above logs, provide a code-level optimization plan"},
]


CODEC = ServeCodec(make_codec("jointrl", None))  # what `jointrl serve` picks for a checkpoint with the shipped tokenizer
SEED_NAMES = ("ultra-moe-model", "sparse-moe-2.8t")  # the model names the seed articles' examples use


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    ckpt = build_test_checkpoint(tmp / "tiny-qwen3moe-chat")
    # --served-name repeated: the checkpoint's own name first (what the other tests use), then the seeds' aliases.
    names = [a for n in (ckpt.name, *SEED_NAMES) for a in ("--served-name", n)]
    with running_server(str(ckpt), tmp, extra_args=(*names, "--max-model-len", "384")) as srv:
        yield srv


def _extra(obj, key):
    return (getattr(obj, "model_extra", None) or {}).get(key, getattr(obj, key, None))


def _check_record_matches(server: Server, rec, resp, messages, tools):
    """The record holds the exact prompt ids, the generated ids and a consistent loss mask / logprobs."""
    req = parse_chat_request({"model": server.model, "messages": messages, "tools": tools}, ServeSettings(), [server.model], CODEC)
    want_prompt = server.tok.encode(chat.render(req.messages, tools, add_generation_prompt=True), add_special_tokens=False)
    assert list(rec.prompt_token_ids) == want_prompt
    assert resp.usage.prompt_tokens == len(want_prompt)
    assert resp.usage.completion_tokens == sum(len(c.completion_token_ids) for c in rec.choices)
    for c in rec.choices:
        assert len(c.logprobs) == len(c.loss_mask) == len(c.completion_token_ids)
        for lp, m in zip(c.logprobs, c.loss_mask):
            assert (lp is None) == (m == 0)
            assert lp is None or (math.isfinite(lp) and lp <= 0)
        assert c.text == server.tok.decode(list(c.completion_token_ids), skip_special_tokens=False)[: len(c.text)]


def test_models_endpoint(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [server.model, *SEED_NAMES]
    assert models.data[0].model_extra["max_model_len"] == 384  # --max-model-len reached the engine


# ----------------------------------------------------------------------------- the seed articles' examples, as written
# Copied from the seed articles (the API's documented usage). Only the host:port of their URLs is the test server's.
def seed_example_1(base):
    import requests
    # Assume deployment on a local or cloud container platform
    api_url = f"{base}/v1/chat/completions"
    headers = {"Content-Fi": "application/json"}
    # Build multi-turn conversation history, retaining complete thinking process and tool call records
    messages = [
    {"role": "user", "content": "Check recent CPU utilization logs and generate optimization suggestions"},
    # Retain the model's thinking process
    {"role": "assistant", "content": "Thinking: Need to call the monitoring alert API to get CPU data.", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_cpu_usage"}}]},
    # Retain the tool's returned result
    {"role": "tool", "tool_call_id": "call_1", "content": "Average CPU utilization reached 85%"},
    # Model continues reasoning based on history
    {"role": "user", "content": "Based on the above logs, provide a code-level optimization plan"}
    ]
    payload = {
    "model": "ultra-moe-model",
    "messages": messages,
    "thinking_budget": "max" # Set thinking budget to the highest tier
    }
    response = requests.post(api_url, json=payload, headers=headers)
    print(response.json())
    return response


def seed_example_2(base):
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    def call_agent_api(task_description, budget="max", max_retries=3):
        url = f"{base}/v1/chat/completions"
        headers = {"Content-Type": "application/json"}
        payload = {"model": "sparse-moe-2.8t","messages": [{"role": "user", "content": task_description}],"tools": [{"type": "function","function": {"name": "search_web","description": "Search the internet for the latest information","parameters": {"type": "object","properties": {"query": {"type": "string"}}}}}],"tool_choice": "auto","extra_body": {"thinking_budget": budget}}
        session = requests.Session()
        retries = Retry(total=max_retries, backoff_factor=1, status_forcelist=[502, 503, 504])
        session.mount("http://", HTTPAdapter(max_retries=retries))
        session.mount("https://", HTTPAdapter(max_retries=retries))
        try:
            response = session.post(url, json=payload, headers=headers, timeout=120)
            response.raise_for_status()
            return response.json()
        except requests.RequestException as e:
            print(f"API call failed: {e}")
            return None
    return call_agent_api


def test_seed_examples_run_as_written(server):
    r = seed_example_1(server.base)
    assert r.status_code == 200, r.text
    body = r.json()
    rec = server.record(body["id"])
    assert rec.model == "ultra-moe-model" and rec.request["thinking_tier"] == "max" and rec.request["thinking_budget_tokens"] is None
    assert body["usage"]["completion_tokens"] == len(rec.choices[0].completion_token_ids) > 0
    call = seed_example_2(server.base)
    for budget in ("low", "max"):
        out = call("Find the latest CPU optimisation guides", budget=budget)
        assert out is not None and out["model"] == "sparse-moe-2.8t"
        rec = server.record(out["id"])
        assert rec.request["thinking_tier"] == budget  # the raw-JSON extra_body form is the tier
        assert rec.request["tools"][0]["function"]["name"] == "search_web" and rec.request["tool_choice"] == "auto"


def test_seed_tool_conversation_max_budget(server):
    resp = server.client.chat.completions.create(
        model=server.model, messages=SEED_MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=24, seed=1,
        extra_body={"thinking_budget": "max"})
    ch = resp.choices[0]
    assert ch.finish_reason in ("length", "stop", "tool_calls")
    rec = server.record(resp.id)
    assert rec.request["thinking_tier"] == "max" and rec.request["thinking_budget_tokens"] is None
    assert rec.request["messages"] == SEED_MESSAGES
    _check_record_matches(server, rec, resp, SEED_MESSAGES, TOOLS)
    rc = rec.choices[0]
    assert set(rc.loss_mask) == {1}  # no tool_choice forcing: every token was sampled
    parsed = chat.parse_assistant(rc.text, turn=1)
    assert _extra(ch.message, "reasoning_content") == parsed.message.reasoning
    assert (ch.message.content or "") == parsed.message.content
    assert [(t.function.name, t.function.arguments) for t in (ch.message.tool_calls or [])] == [(t.name, t.arguments) for t in parsed.message.tool_calls]
    # the conversation continues: the reply goes back into the history, then a tool result and a user turn
    follow = SEED_MESSAGES + [ch.message.model_dump(exclude_none=True)] + [{"role": "user", "content": "Summarise the plan."}]
    resp2 = server.client.chat.completions.create(model=server.model, messages=follow, tools=TOOLS, max_tokens=8, seed=2,
                                                  extra_body={"reasoning_effort": "max"})
    rec2 = server.record(resp2.id)
    assert rec2.request["thinking_tier"] == "max"
    assert len(rec2.prompt_token_ids) > len(rec.prompt_token_ids) and resp2.usage.completion_tokens <= 8


def test_low_budget_forces_end_of_thinking(server):
    resp = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=LOW + 24, seed=3,
        extra_body={"thinking_budget": "low"})
    rec = server.record(resp.id)
    ids = list(rec.choices[0].completion_token_ids)
    assert rec.request["thinking_budget_tokens"] == LOW
    # the prompt ends with <think>; the thinking segment is what is generated before </think>
    assert chat.THINK_END_ID in ids, "thinking did not end within max_tokens"
    n_think = ids.index(chat.THINK_END_ID)
    assert n_think <= LOW
    assert len(ids) > n_think + 1  # the answer follows the forced </think>
    assert resp.usage.completion_tokens_details.reasoning_tokens == n_think
    assert _extra(resp.choices[0].message, "reasoning_content") is not None


def test_streaming(server):
    stream = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=32, seed=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"thinking_budget": 8})
    rid, reasoning, content, finishes, usage = None, [], [], [], None
    for chunk in stream:
        rid = chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            r = _extra(c.delta, "reasoning_content")
            if r:
                reasoning.append(r)
            if c.delta.content:
                content.append(c.delta.content)
            if c.finish_reason:
                finishes.append(c.finish_reason)
    rec = server.record(rid)
    parsed = chat.parse_assistant(rec.choices[0].text, turn=0)
    assert "".join(reasoning) == (parsed.message.reasoning or "")
    assert "".join(content) == parsed.message.content
    assert len(reasoning) > 1  # token-aligned deltas, not one blob
    assert finishes == [rec.choices[0].finish_reason]
    assert usage.completion_tokens == len(rec.choices[0].completion_token_ids)
    # raw SSE: OpenAI framing, ends with [DONE]
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", timeout=120, json={
            "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_choice_forces_a_call(server, choice):
    tool_choice = {"type": "function", "function": {"name": "get_cpu_usage"}} if choice == "named" else "required"
    resp = server.client.chat.completions.create(
        model=server.model, messages=SEED_MESSAGES[:1], tools=TOOLS, tool_choice=tool_choice, max_tokens=40, seed=5,
        extra_body={"thinking_budget": 6})
    rec = server.record(resp.id)
    rc = rec.choices[0]
    ids, mask = list(rc.completion_token_ids), list(rc.loss_mask)
    end = ids.index(chat.THINK_END_ID)
    assert end <= 6
    forced = [i for i, m in enumerate(mask) if m == 0]
    assert forced and forced[0] == end + 1
    span = forced[: next((k for k in range(1, len(forced)) if forced[k] != forced[k - 1] + 1), len(forced))]  # the first run
    # (the opening and the name: one span, right after </think>)
    opening = server.tok.decode([ids[i] for i in span], skip_special_tokens=False)
    names = [t["function"]["name"] for t in TOOLS]
    # the name is the server's (named) or chosen under vLLM's structured outputs among the request's tools (required)
    assert opening in ['\n\n<tool_call>\n{"name": ' + json.dumps(n) + ', "arguments": ' for n in (["get_cpu_usage"] if choice == "named" else names)]
    ch = resp.choices[0]
    if ch.finish_reason == "tool_calls":  # the arguments (a JSON object under a grammar) ended within max_tokens
        assert [t.function.name for t in ch.message.tool_calls] == [json.loads(opening.split('"name": ')[1].split(", ")[0])]
        closing = server.tok.decode([ids[i] for i in forced[len(span):]], skip_special_tokens=False)
        assert closing == "}\n</tool_call><|im_end|>" and all(m == 1 for m in mask[span[-1] + 1: forced[len(span)]])
    else:
        assert ch.finish_reason == "length" and not ch.message.tool_calls


def test_n_choices(server):
    resp = server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=6, seed=9)
    assert [c.index for c in resp.choices] == [0, 1]
    rec = server.record(resp.id)
    assert len(rec.choices) == 2 and rec.choices[0].completion_token_ids != rec.choices[1].completion_token_ids
    assert resp.usage.completion_tokens == sum(len(c.completion_token_ids) for c in rec.choices)


def test_concurrent_requests_share_the_engine(server):
    results, errors = [], []

    def one(i):
        try:
            results.append(server.client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=32, seed=100 + i,
                extra_body={"thinking_budget": "low"}))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors and len(results) == 4
    health = httpx.get(f"{server.base}/health", timeout=10).json()
    assert health["peak_inflight"] >= 2, health  # several HTTP requests were in the engine at once (batched by vLLM)
    assert health["inflight"] == 0


def test_invalid_requests_get_openai_errors(server):
    url = f"{server.base}/v1/chat/completions"
    ok_msgs = [{"role": "user", "content": "hi"}]
    long_text = " ".join(f"word{i}" for i in range(3000))  # > max_model_len tokens
    cases = [
        ("bad json", b'{"model": "x", "messages": [', 400),
        ("missing messages", {"model": server.model}, 400),
        ("bad role", {"model": server.model, "messages": [{"role": "robot", "content": "x"}]}, 400),
        ("unknown thinking budget", {"model": server.model, "messages": ok_msgs, "thinking_budget": "huge"}, 400),
        ("unknown reasoning_effort", {"model": server.model, "messages": ok_msgs, "reasoning_effort": "extreme"}, 400),
        ("max_tokens 0", {"model": server.model, "messages": ok_msgs, "max_tokens": 0}, 400),
        ("max_completion_tokens negative", {"model": server.model, "messages": ok_msgs, "max_completion_tokens": -1}, 400),
        ("context overflow", {"model": server.model, "messages": [{"role": "user", "content": long_text}]}, 400),
        ("unknown model", {"model": "gpt-17", "messages": ok_msgs}, 404),
        ("n too large", {"model": server.model, "messages": ok_msgs, "n": 1000}, 400),
        ("tool_choice without tools", {"model": server.model, "messages": ok_msgs, "tool_choice": "required"}, 400),
    ]
    for name, payload, status in cases:
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) > 10, (name, err)
    r = httpx.post(url, content=json.dumps(cases[7][1]).encode(), timeout=60)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.get(f"{server.base}/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(url, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"]
    # the openai client sees the same errors as typed exceptions
    with pytest.raises(openai.BadRequestError, match="thinking_budget"):
        server.client.chat.completions.create(model=server.model, messages=ok_msgs, extra_body={"thinking_budget": "extreme"})
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="not-served", messages=ok_msgs)
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200  # still serving
