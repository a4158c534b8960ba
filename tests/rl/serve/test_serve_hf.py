"""`jointrl serve DIR` on pulled checkpoints, speaking their own chat format (the `hf` codec), end to end.

Real parts throughout: `jointrl serve` as a subprocess (in-process vLLM engine, fp32), the `openai`
and `anthropic` client libraries over HTTP, SmolLM2-135M-Instruct's own chat template through
`apply_chat_template`, vLLM's `hermes` tool parser, and the server's JSONL records. SmolLM2's
template has no tool section and no thinking block: tools are presented Hermes-style in the system
message, and thinking tiers only cap the reply. The upcycled MoE (`smollm2-135m-moe`) is served once.
"""
from __future__ import annotations

import json

import anthropic
import pytest

from rl.config import RolloutSection
from rl.rollout.codec.hf import HERMES_TOOLS_FOOTER, HERMES_TOOLS_HEADER
from rl.serve import read_records, recorded_sequence
from tests.rl.serve.serve_fixture import running_server

pytestmark = pytest.mark.slow

NAME = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LOW = RolloutSection().thinking_budgets["low"]
GREEDY = {"temperature": 0}  # the anthropic client (2.x) no longer takes temperature as an argument; the route reads it


def _pull(name: str):
    from model import hub

    return hub.pull(name)  # a cache hit after the first pull (file-locked, so parallel runs build once)


def test_serve_the_upcycled_moe_directory(tmp_path):
    """The 4-expert MoE starts (vLLM's fused MoE, fp32) and answers through its own template like the dense model."""
    moe = _pull("smollm2-135m-moe")
    with running_server(str(moe), tmp_path, served_name="moe", extra_args=("--served-name", "moe", "--max-model-len", "512")) as srv:
        assert [m.id for m in srv.client.models.list().data] == ["moe"]
        resp = srv.client.chat.completions.create(model="moe", messages=QUESTION, temperature=0, max_tokens=24)
        assert "Paris" in resp.choices[0].message.content
        rec = srv.record(resp.id)
        assert rec.choices[0].completion_token_ids[-1] == 2  # <|im_end|>: the template's end of turn stopped it


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from transformers import AutoTokenizer

    path = _pull("smollm2-135m")
    tmp = tmp_path_factory.mktemp("serve_smollm2")
    with running_server(str(path), tmp, served_name=NAME, extra_args=("--served-name", NAME, "--max-model-len", "1024")) as srv:
        srv.tok = AutoTokenizer.from_pretrained(str(path))  # the checkpoint's own tokenizer, not the shipped one
        yield srv


def _template_ids(srv, messages) -> list[int]:
    return srv.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_openai_route_prompt_is_the_templates_rendering_and_answers_paris(smol):
    resp = smol.client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=32)
    msg = resp.choices[0].message
    assert "Paris" in msg.content and resp.choices[0].finish_reason == "stop"
    rec = smol.record(resp.id)
    assert list(rec.prompt_token_ids) == _template_ids(smol, QUESTION)  # SmolLM2's default system line included
    assert resp.usage.prompt_tokens == len(rec.prompt_token_ids)
    c = rec.choices[0]
    assert c.completion_token_ids[-1] == smol.tok.convert_tokens_to_ids("<|im_end|>") and c.message["content"] == msg.content
    assert resp.usage.completion_tokens == len(c.completion_token_ids) and resp.usage.completion_tokens_details.reasoning_tokens == 0
    # streamed, the deltas join to the same (greedy) message
    chunks = list(smol.client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=32, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content


def test_anthropic_route_answers_paris_through_the_same_template(smol):
    client = anthropic.Anthropic(base_url=smol.base, api_key="unused", max_retries=0, timeout=180)
    kw = dict(model=NAME, max_tokens=32, messages=QUESTION, extra_body=GREEDY)
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["text"] and "Paris" in msg.content[0].text and msg.stop_reason == "end_turn"
    rec = smol.record(msg.id)
    assert rec.request["protocol"] == "anthropic" and list(rec.prompt_token_ids) == _template_ids(smol, QUESTION)
    assert msg.usage.input_tokens == len(rec.prompt_token_ids)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == msg.content[0].text
    # a system prompt replaces SmolLM2's default one, as its template does
    sys_msg = client.messages.create(**{**kw, "system": "Answer in one word."})
    want = _template_ids(smol, [{"role": "system", "content": "Answer in one word."}, *QUESTION])
    assert list(smol.record(sys_msg.id).prompt_token_ids) == want


def test_a_tool_request_gets_the_hermes_tool_section_and_forced_calls_parse(smol):
    """Tools go Hermes-style into the system message, an earlier call into the assistant text and its result into
    a <tool_response>; a named tool_choice writes the call's opening, the model the rest, vLLM's hermes parser reads it."""
    london = '{"city": "London"}'
    ask = [{"role": "user", "content": "What is the weather in London?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function",
                                                                  "function": {"name": "get_weather", "arguments": london}}]},
           {"role": "tool", "tool_call_id": "call_9", "content": "Rainy, 12 C"},
           {"role": "assistant", "content": "It is rainy in London, 12 C."},
           {"role": "user", "content": "What is the weather in Paris?"}]
    resp = smol.client.chat.completions.create(model=NAME, messages=ask, tools=[TOOL], temperature=0, max_tokens=48,
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    rec = smol.record(resp.id)
    system = HERMES_TOOLS_HEADER + "\n" + json.dumps(TOOL) + HERMES_TOOLS_FOOTER
    as_template = [{"role": "system", "content": system}, ask[0],
                   {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>' % london},
                   {"role": "tool", "content": "<tool_response>\nRainy, 12 C\n</tool_response>"}, ask[3], ask[4]]
    assert list(rec.prompt_token_ids) == _template_ids(smol, as_template)
    prompt_text = smol.tok.decode(list(rec.prompt_token_ids))
    assert prompt_text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in prompt_text.split("<|im_end|>")[0]
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert resp.choices[0].finish_reason == "tool_calls" and call.id == "call_2_0"  # the third assistant turn
    # the call's opening and its closing were written by the server (loss mask 0, no logprob); the arguments
    # between them sampled by the model under vLLM's JSON-object grammar
    c = rec.choices[0]
    forced = [i for i, m in enumerate(c.loss_mask) if m == 0]
    assert all(c.logprobs[i] is None for i in forced)
    n_open = next((k for k in range(1, len(forced)) if forced[k] != forced[k - 1] + 1), len(forced))
    opening, closing = forced[:n_open], forced[n_open:]
    assert opening == list(range(n_open)) and closing == list(range(len(c.loss_mask) - len(closing), len(c.loss_mask)))
    assert smol.tok.decode([c.completion_token_ids[i] for i in opening]) == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert smol.tok.decode([c.completion_token_ids[i] for i in closing], skip_special_tokens=False) == "}\n</tool_call><|im_end|>"

    client = anthropic.Anthropic(base_url=smol.base, api_key="unused", max_retries=0, timeout=180)
    anth_ask = [ask[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "call_9", "name": "get_weather", "input": {"city": "London"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_9", "content": "Rainy, 12 C"}]}, ask[3], ask[4]]
    msg = client.messages.create(model=NAME, max_tokens=48, extra_body=GREEDY, messages=anth_ask, tool_choice={"type": "tool", "name": "get_weather"},
                                 tools=[{"name": "get_weather", "description": TOOL["function"]["description"],
                                         "input_schema": TOOL["function"]["parameters"]}])
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"] and isinstance(uses[0].input, dict)
    assert list(smol.record(msg.id).prompt_token_ids) == list(rec.prompt_token_ids)  # the same history, the same prompt
    assert json.loads(call.function.arguments) == uses[0].input  # greedy: the same call through both routes


def test_the_next_turn_reuses_the_sampled_ids_and_records_one_sequence(smol):
    first = smol.client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=32)
    convo = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And the capital of Italy?"}]
    second = smol.client.chat.completions.create(model=NAME, messages=convo, temperature=0, max_tokens=32)
    r1, r2 = smol.record(first.id), smol.record(second.id)
    assert r2.continues == (r1.id, 0)
    assert r2.prompt_reused_tokens == len(r1.prompt_token_ids) + len(r1.choices[0].completion_token_ids)
    assert smol.tok.decode(list(r2.prompt_token_ids)) == smol.tok.decode(_template_ids(smol, convo))
    seq = recorded_sequence(read_records(smol.record_dir), r2.id)
    assert seq.record_ids == (r1.id, r2.id)
    assert seq.token_ids == tuple(r2.prompt_token_ids) + tuple(r2.choices[0].completion_token_ids)


def test_thinking_tiers_cap_the_reply_of_a_model_without_a_thinking_block(smol):
    story = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
    resp = smol.client.chat.completions.create(model=NAME, messages=story, temperature=0, max_tokens=500, extra_body={"thinking_budget": 3})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    client = anthropic.Anthropic(base_url=smol.base, api_key="unused", max_retries=0, timeout=180)
    low = client.messages.create(model=NAME, max_tokens=500, extra_body=GREEDY, messages=story, thinking={"type": "enabled", "budget_tokens": LOW})
    assert low.usage.output_tokens == LOW and low.stop_reason == "max_tokens"
    assert smol.record(low.id).request["thinking_tier"] == "low"
    # thinking disabled: nothing to close, and nothing capped beyond max_tokens
    off = client.messages.create(model=NAME, max_tokens=LOW + 10, extra_body=GREEDY, messages=story, thinking={"type": "disabled"})
    assert off.usage.output_tokens > LOW
