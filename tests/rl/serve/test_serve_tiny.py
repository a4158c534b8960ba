"""`jointrl serve tiny`: the shipped HybridMoe config (random weights, fixed seed) through the vLLM plugin (bf16 on CPU).

One server, two requests: the seed-shaped tool conversation with `thinking_budget: "max"`, and a
`low`-budget request whose thinking is forced to end at the budget.
"""
from __future__ import annotations

import pytest

from model import chat
from rl.config import RolloutSection
from tests.rl.serve.serve_fixture import running_server

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


def _data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_images_reach_the_model_on_both_routes_and_bad_ones_are_4xx(server):
    import base64

    import httpx

    from tests.helpers.image_env import png

    a, b = png(32, 32, 1), png(64, 32, 2)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                         {"type": "image_url", "image_url": {"url": _data_url(a)}}]}]
    r1 = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    ids1 = server.record(r1.id).prompt_token_ids
    assert ids1.count(chat.IMAGE_ID) == 4  # 32 x 32 at patch 16: one placeholder per patch
    msgs[0]["content"][1]["image_url"]["url"] = _data_url(png(32, 32, 3))
    r2 = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    assert server.record(r2.id).prompt_token_ids == ids1  # same tokens, other pixels ...
    lp = lambda r: [t.logprob for t in r.choices[0].logprobs.content]  # noqa: E731
    assert lp(r1) != lp(r2)  # ... and the model saw the difference

    # Anthropic: an image block in a user turn and one in a tool result
    body = {"model": "tiny", "max_tokens": 4, "tools": [{"name": "look", "input_schema": {"type": "object", "properties": {}}}],
            "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                                   "data": base64.b64encode(a).decode()}},
                                                      {"type": "text", "text": "Look closer."}]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                             {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b).decode()}}]}]}]}
    r = httpx.post(f"{server.base}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert server.record(r.json()["id"]).prompt_token_ids.count(chat.IMAGE_ID) == 4 + 8

    def post(content):
        return httpx.post(f"{server.base}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})

    for content, code in (
        ([{"type": "image_url", "image_url": {"url": _data_url(png(30, 30))}}], "invalid_image"),  # not a multiple of 16
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNGjunk").decode()}}], "invalid_image"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "invalid_image"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "image_url_unsupported"),
        ([{"type": "image_url", "image_url": {"url": _data_url(png(16, 16, i))}} for i in range(5)], "too_many_images"),
    ):
        r = post(content)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert post("still fine?").status_code == 200  # the server goes on after every refusal


def test_record_dir_keeps_each_request_s_images_so_the_episode_can_be_trained_on(server):
    """Two turns through the OpenAI client; the second re-sends both images and adds one. Each distinct image is
    stored once under its sha256; the sequence rebuilt from the record has the images, in order, on spans of
    placeholders, and collates into a trainer batch whose image mask covers exactly those spans."""
    import hashlib

    import pytest as _pytest

    from rl.rollout.multimodal import check_spans
    from rl.serve import read_records, recorded_sequence
    from rl.trainer.batch import collate
    from rl.types import Episode
    from tests.helpers.image_env import png

    a, b, c = png(32, 32, 11), png(64, 32, 12), png(16, 48, 13)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(a)}},
                                         {"type": "text", "text": "Compare these."},
                                         {"type": "image_url", "image_url": {"url": _data_url(b)}}]}]
    r1 = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content or ""},
             {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                          {"type": "image_url", "image_url": {"url": _data_url(c)}}]}]
    r2 = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    recs = read_records(server.record_dir)
    rec1, rec2 = (next(r for r in recs if r.id == rid) for rid in (r1.id, r2.id))
    sha = lambda d: hashlib.sha256(d).hexdigest()  # noqa: E731
    assert [im.sha256 for im in rec1.images] == [sha(a), sha(b)]
    assert [im.sha256 for im in rec2.images] == [sha(a), sha(b), sha(c)]
    assert [im.length for im in rec2.images] == [4, 8, 3]
    stored = {p.name for p in (server.record_dir / "images").iterdir()}
    assert {f"{sha(d)}.png" for d in (a, b, c)} <= stored  # once each, whatever the number of turns that sent it
    with _pytest.raises(ValueError, match="pass record_dir"):
        recorded_sequence(recs, r2.id)
    seq = recorded_sequence(recs, r2.id, record_dir=server.record_dir)
    assert [im.data for im in seq.images] == [a, b, c]
    check_spans(seq.token_ids, seq.images, chat.IMAGE_ID)  # every placeholder fed by exactly its image
    assert all(seq.loss_mask[i] == 0 for im in seq.images for i in range(im.start, im.start + im.length))
    ep = Episode(task_id="served", domain="serve", group_id="g", token_ids=seq.token_ids, loss_mask=seq.loss_mask,
                 rollout_logprobs=seq.logprobs, messages=(), reward=1.0, images=seq.images)
    batch = collate([ep], [1.0])
    assert int(batch.image_mask_BT.sum()) == 4 + 8 + 3 and batch.images_B == (seq.images,)
