"""`jointrl serve tiny`: the shipped HybridMoe config (random weights, fixed seed) through the vLLM plugin (bf16 on CPU).

One server, two requests: the seed-shaped tool conversation with `thinking_budget: "max"`, and a
`low`-budget request whose thinking is forced to end at the budget.
"""
from __future__ import annotations

import pytest

from model import chat
from rl.config import RolloutSection
from tests.rl.serve_fixture import running_server

pytestmark = pytest.mark.slow

LOW = RolloutSection().thinking_budgets["low"]
TOOLS = [{"type": "function", "function": {"name": "get_cpu_usage", "parameters": {"type": "object", "properties": {}}}}]
SEED_MESSAGES = [
    {"role": "user", "content": "Check recent CPU utilization logs and generate optimization suggestions"},
    {"role": "assistant", "content": "Thinking: Need to call the monitoring alert API to get CPU data.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_cpu_usage"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Average CPU utilization reached 85%"},
    {"role": "user", "content": "Based on the above logs, provide a code-level optimization plan"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("tiny", tmp_path_factory.mktemp("serve_tiny"), served_name="tiny") as srv:
        yield srv


def test_tiny_serves_the_seed_conversation_and_budgets(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    resp = server.client.chat.completions.create(model="tiny", messages=SEED_MESSAGES, tools=TOOLS, max_tokens=16, seed=1,
                                                 extra_body={"thinking_budget": "max"})
    rec = server.record(resp.id)
    assert rec.request["thinking_budget_tokens"] is None
    assert resp.usage.completion_tokens == len(rec.choices[0].completion_token_ids) <= 16
    assert (resp.choices[0].message.model_extra or {}).get("reasoning_content") == chat.parse_assistant(rec.choices[0].text, 1).message.reasoning

    resp = server.client.chat.completions.create(model="tiny", messages=SEED_MESSAGES[:1], max_tokens=LOW + 8, seed=2,
                                                 extra_body={"reasoning_effort": "low"})
    ids = list(server.record(resp.id).choices[0].completion_token_ids)
    assert chat.THINK_END_ID in ids and ids.index(chat.THINK_END_ID) <= LOW
    assert resp.usage.completion_tokens_details.reasoning_tokens == ids.index(chat.THINK_END_ID)
