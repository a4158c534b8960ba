"""Tests for model/chat.py: the Python renderer against the shipped Jinja template (via the real
transformers `apply_chat_template`), the prefix / append properties an agent loop relies on,
parse(render(m)) == m on random conversations, and malformed generations never raising."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from jointrl.records import Message, ToolCall
from model import chat
from model.chat import (
    CHAT_TEMPLATE,
    GENERATION_PROMPT,
    SPECIAL_TOKENS,
    ParsedAssistant,
    parse_assistant,
    parse_conversation,
    render,
    render_completion,
    render_message,
    render_turn_suffix,
    to_template_messages,
    tool_call_id,
)

# Text fragments chosen to stress escaping and whitespace handling: JSON syntax, quotes,
# backslashes, newlines at the edges, unicode (accents, CJK, emoji, RTL), near-misses of the
# special tokens. Full special-token strings are excluded: they are outside the round-trip
# domain by design (documented in model/chat.py).
FRAGMENTS = (
    "hello", "world", "ls -la", "def f(x):\n    return {x: 1}", "{", "}", "{}", "[1, 2]", '"', "'",
    "\\", "\\n", "\n", "\n\n", "\t", " ", "  ", "é", "ü", "中文", "😀", "שלום", "</tool", "<tool_cal",
    "<think", "think>", "<|im_", "end|>", '"arguments":', '{"name": "x"}', "```json", "}}", "{{", "%",
    "{% raw %}", "{{ messages }}", "null", "true", "0.5", "-1", "\r\n", "# Tools", "<tools>", "a" * 40,
)
NAMES = ("bash", "read_file", "write_file", "search", "run_cad", "submit", "f", "tool.with.dots", "名前")
TOOLS = (
    {"type": "function", "function": {"name": "bash", "description": "Run a command; say \"hi\" {ok}",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "description": "Söka — 検索 😀",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "k": {"type": "integer"}}}}},
    {"name": "bare_schema", "parameters": {"type": "object", "properties": {}}},
)


def rand_text(rng: random.Random, allow_empty: bool = True, max_parts: int = 6) -> str:
    while True:
        n = rng.randint(0 if allow_empty else 1, max_parts)
        text = "".join(rng.choice(FRAGMENTS) for _ in range(n))
        if not any(t in text for t in SPECIAL_TOKENS):  # near-misses may join into a real one
            return text


def rand_json_value(rng: random.Random, depth: int = 0):
    k = rng.randrange(6 if depth < 2 else 4)
    if k == 0:
        return rand_text(rng)
    if k == 1:
        return rng.choice((rng.randint(-10**6, 10**6), rng.uniform(-1e3, 1e3), True, False, None))
    if k == 2:
        return rand_text(rng, max_parts=3)
    if k == 3:
        return rng.randint(0, 9)
    if k == 4:
        return [rand_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rand_text(rng, max_parts=2): rand_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def rand_arguments(rng: random.Random) -> str:
    obj = {rand_text(rng, allow_empty=False, max_parts=2): rand_json_value(rng) for _ in range(rng.randint(0, 4))}
    style = rng.randrange(4)
    if style == 0:
        return json.dumps(obj, ensure_ascii=False)
    if style == 1:
        return json.dumps(obj, ensure_ascii=True)
    if style == 2:
        return json.dumps(obj, separators=(",", ":"))
    return json.dumps(obj, indent=2, ensure_ascii=False)


def rand_conversation(rng: random.Random, canonical: bool = True) -> list[Message]:
    """A random multi-turn tool conversation in the round-trip domain (canonical ids)."""
    msgs: list[Message] = []
    if rng.random() < 0.7:
        msgs.append(Message("system", rand_text(rng, allow_empty=False)))
    msgs.append(Message("user", rand_text(rng)))
    turn = 0
    for _ in range(rng.randint(1, 6)):
        n_calls = rng.choice((0, 0, 1, 1, 2, 3))
        calls = tuple(ToolCall(tool_call_id(turn, i), rng.choice(NAMES), rand_arguments(rng)) for i in range(n_calls))
        reasoning = rand_text(rng, allow_empty=False) if rng.random() < 0.8 else None
        msgs.append(Message("assistant", rand_text(rng), tool_calls=calls, reasoning=reasoning))
        for i in range(n_calls if rng.random() < 0.9 else max(n_calls - 1, 0)):
            msgs.append(Message("tool", rand_text(rng), tool_call_id=tool_call_id(turn, i)))
        if n_calls == 0 or rng.random() < 0.2:
            msgs.append(Message("user", rand_text(rng)))
        turn += 1
    if not canonical and rng.random() < 0.5:  # images only where parsing is not checked
        i = rng.randrange(len(msgs))
        if msgs[i].role in ("user", "tool"):
            m = msgs[i]
            msgs[i] = Message(m.role, m.content, tool_call_id=m.tool_call_id, images=(b"png",) * rng.randint(1, 3))
    return msgs


CONVERSATIONS = [rand_conversation(random.Random(seed)) for seed in range(300)]


@pytest.fixture(scope="module")
def tok():
    return chat.load_tokenizer()


# --------------------------------------------------------------------------- the format itself
def test_golden_example_spells_the_documented_format():
    # Written by hand from the format spec in the module docstring / docs/chat_format.md.
    msgs = [
        Message("system", "Be brief."),
        Message("user", "What is in /tmp?"),
        Message("assistant", "Let me look.", reasoning="Use ls.",
                tool_calls=(ToolCall("call_0_0", "bash", '{"command": "ls /tmp"}'),)),
        Message("tool", "a.txt", tool_call_id="call_0_0"),
        Message("assistant", "One file: a.txt."),
    ]
    tools = [{"type": "function", "function": {"name": "bash"}}]
    want = (
        "<|im_start|>system\nBe brief.\n\n" + chat.TOOLS_HEADER
        + '\n{"type": "function", "function": {"name": "bash"}}' + chat.TOOLS_FOOTER + "<|im_end|>\n"
        "<|im_start|>user\nWhat is in /tmp?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse ls.\n</think>\n\nLet me look.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls /tmp"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\na.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nOne file: a.txt.<|im_end|>\n"
        "<|im_start|>assistant\n<think>"
    )
    assert render(msgs, tools=tools, add_generation_prompt=True) == want
    assert chat.TOOLS_HEADER.startswith("# Tools") and "<tools>" in chat.TOOLS_HEADER
    assert GENERATION_PROMPT == "<|im_start|>assistant\n<think>"


def test_special_token_constants_are_consistent():
    assert len(SPECIAL_TOKENS) == 11 and len(set(SPECIAL_TOKENS)) == 11
    ids = {
        "<|pad|>": chat.PAD_ID, "<|endoftext|>": chat.ENDOFTEXT_ID, "<|im_start|>": chat.IM_START_ID,
        "<|im_end|>": chat.IM_END_ID, "<think>": chat.THINK_START_ID, "</think>": chat.THINK_END_ID,
        "<tool_call>": chat.TOOL_CALL_START_ID, "</tool_call>": chat.TOOL_CALL_END_ID,
        "<tool_response>": chat.TOOL_RESPONSE_START_ID, "</tool_response>": chat.TOOL_RESPONSE_END_ID,
        "<|image|>": chat.IMAGE_ID,
    }
    assert ids == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert chat.REASONING_START_STR == "<think>" and chat.REASONING_END_STR == "</think>"
    assert chat.EOS_ID == chat.IM_END_ID and chat.IM_END_ID in chat.STOP_TOKEN_IDS


# --------------------------------------------------------------------------- Jinja == Python
@pytest.mark.parametrize("tools", [None, list(TOOLS)], ids=["no_tools", "tools"])
@pytest.mark.parametrize("gen", [False, True], ids=["no_gen", "gen"])
def test_apply_chat_template_equals_render(tok, tools, gen):
    n = 0
    for seed in range(120):
        msgs = rand_conversation(random.Random(10_000 + seed), canonical=False)
        want = render(msgs, tools=tools, add_generation_prompt=gen)
        got = tok.apply_chat_template(to_template_messages(msgs), tools=tools, add_generation_prompt=gen, tokenize=False)
        assert got == want, f"seed {seed}"
        n += 1
    assert n == 120


def test_apply_chat_template_edge_cases(tok):
    cases = [
        ([Message("user", "")], list(TOOLS)),
        ([Message("system", "")], list(TOOLS)),  # empty system text: no blank lines before # Tools
        ([Message("user", "hi"), Message("system", "late system turn")], list(TOOLS)),
        ([Message("assistant", "", tool_calls=(ToolCall("x", "f", "{}"), ToolCall("y", "g", '{"a": [1]}')))], None),
        ([Message("user", "look", images=(b"1", b"2"))], None),
        ([Message("user", "", images=(b"1",))], None),
        ([Message("tool", "", tool_call_id="call_0_0")], None),
    ]
    for msgs, tools in cases:
        for gen in (False, True):
            want = render(msgs, tools=tools, add_generation_prompt=gen)
            got = tok.apply_chat_template(to_template_messages(msgs), tools=tools, add_generation_prompt=gen, tokenize=False)
            assert got == want, (msgs, tools, gen)


def test_template_accepts_vllm_style_dict_arguments(tok):
    # vLLM's server json.loads tool-call arguments before templating; the template then uses
    # tojson, which equals render() when the original text was json.dumps-formatted.
    rng = random.Random(7)
    for _ in range(50):
        args = {rand_text(rng, allow_empty=False, max_parts=2): rand_json_value(rng) for _ in range(3)}
        msg = Message("assistant", rand_text(rng), reasoning="r",
                      tool_calls=(ToolCall("call_0_0", "bash", json.dumps(args, ensure_ascii=False)),))
        d = to_template_messages([msg])
        d[0]["tool_calls"][0]["function"]["arguments"] = args
        assert tok.apply_chat_template(d, tokenize=False) == render([msg])


def test_template_reads_reasoning_key_and_content_parts(tok):
    d = [{"role": "assistant", "content": None, "reasoning": "plan"},
         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
                                      {"type": "text", "text": "b"}]}]
    got = tok.apply_chat_template(d, tokenize=False)
    assert got == ("<|im_start|>assistant\n<think>\nplan\n</think>\n\n<|im_end|>\n"
                   "<|im_start|>user\na<|image|>b<|im_end|>\n")


def test_template_rejects_unknown_role(tok):
    with pytest.raises(Exception, match="unknown message role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_shipped_template_is_this_modules_template(tok):
    assert tok.chat_template == CHAT_TEMPLATE


# --------------------------------------------------------------------------- prefix / append
def test_prefix_property_at_every_turn_boundary():
    checked = 0
    for msgs in CONVERSATIONS:
        for tools in (None, list(TOOLS)):
            first = 1 if (tools and msgs[0].role == "system") else 0
            for k in range(first, len(msgs)):
                assert render(msgs[: k + 1], tools=tools).startswith(render(msgs[:k], tools=tools))
                checked += 1
    assert checked > 1000


def test_agent_loop_append_equals_full_render():
    """prompt + completion + suffix + completion + ... == render of the whole conversation."""
    checked = 0
    for msgs in CONVERSATIONS:
        for tools in (None, list(TOOLS)):
            a_idx = [i for i, m in enumerate(msgs) if m.role == "assistant" and i > 0]
            text = render(msgs[: a_idx[0]], tools=tools, add_generation_prompt=True)
            for j, i in enumerate(a_idx):
                text += render_completion(msgs[i])
                nxt = a_idx[j + 1] if j + 1 < len(a_idx) else len(msgs)
                last = j + 1 == len(a_idx)
                text += render_turn_suffix(msgs[i + 1 : nxt], add_generation_prompt=not last)
                assert text == render(msgs[:nxt], tools=tools, add_generation_prompt=not last)
                checked += 1
    assert checked > 500


def test_pieces_encode_to_the_same_ids_as_the_whole(tok):
    """Token-in/token-out: encoding the appended pieces separately equals encoding the whole."""
    for msgs in CONVERSATIONS[:60]:
        a_idx = [i for i, m in enumerate(msgs) if m.role == "assistant"]
        ids = tok.encode(render(msgs[: a_idx[0]], tools=list(TOOLS), add_generation_prompt=True), add_special_tokens=False)
        for j, i in enumerate(a_idx):
            ids += tok.encode(render_completion(msgs[i]), add_special_tokens=False)
            nxt = a_idx[j + 1] if j + 1 < len(a_idx) else len(msgs)
            ids += tok.encode(render_turn_suffix(msgs[i + 1 : nxt]), add_special_tokens=False)
        whole = tok.encode(render(msgs, tools=list(TOOLS), add_generation_prompt=True), add_special_tokens=False)
        assert ids == whole


def test_render_completion_ends_with_eos_and_follows_generation_prompt():
    m = Message("assistant", "x", reasoning="y")
    assert render_completion(m) == "\ny\n</think>\n\nx<|im_end|>"
    assert GENERATION_PROMPT + render_completion(m) + "\n" == render_message(m)


# --------------------------------------------------------------------------- parsing
def test_parse_conversation_round_trip():
    for seed, msgs in enumerate(CONVERSATIONS):
        rng = random.Random(seed)
        tools = list(TOOLS) if rng.random() < 0.5 and msgs[0].role == "system" else None
        gen = rng.random() < 0.5
        parsed = parse_conversation(render(msgs, tools=tools, add_generation_prompt=gen))
        assert parsed.errors == (), seed
        assert parsed.messages == tuple(msgs), seed
        assert parsed.tools == (tuple(tools) if tools else None)
        assert parsed.add_generation_prompt == gen


def test_parse_assistant_round_trip_each_turn():
    n = 0
    for msgs in CONVERSATIONS:
        turn = 0
        for m in msgs:
            if m.role != "assistant":
                continue
            for text in (render_completion(m), render_completion(m)[: -len("<|im_end|>")], render_message(m)):
                p = parse_assistant(text, turn=turn)
                assert isinstance(p, ParsedAssistant)
                assert p.errors == () and p.message == m
                assert p.ended == text.rstrip("\n").endswith("<|im_end|>")
            turn += 1
            n += 1
    assert n > 500


def test_parse_assistant_malformed_calls_become_errors():
    text = (
        "plan\n</think>\n\nSure.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        "<tool_call>\n{not json}\n</tool_call>\n"
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>\n'
        '<tool_call>\n["name", "f"]\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": "{\\"x\\": 2}"}\n</tool_call>\n'
        '<tool_call>\n{"name": "h"}\n</tool_call>\n'
        '<tool_call>\n{"name": "k", "arguments": {}, "extra": 1}\n</tool_call>\n'
        '<tool_call>\n{"name": "unterminated", "arguments": {}}'
    )
    p = parse_assistant(text, turn=4)
    assert p.message.content == "Sure." and p.message.reasoning == "plan" and not p.ended
    assert [(c.id, c.name, c.arguments) for c in p.message.tool_calls] == [
        ("call_4_0", "bash", '{"command": "ls"}'),
        ("call_4_1", "g", '{"x": 2}'),  # double-encoded arguments accepted, re-serialised
        ("call_4_2", "h", "{}"),  # missing arguments = no arguments
    ]
    joined = "\n".join(p.errors)
    assert "tool call 1: invalid JSON" in joined
    assert "tool call 2: missing 'name'" in joined
    assert "tool call 3: 'name' must be a non-empty string" in joined
    assert "tool call 4 ('f'): 'arguments' must be a JSON object" in joined
    assert "tool call 5: expected a JSON object" in joined
    assert "unexpected keys ['extra']" in joined
    assert "tool call 9: no closing </tool_call>" in joined
    assert len(p.errors) == 7


def test_parse_assistant_structure_errors():
    p = parse_assistant("thinking forever and <tool_call>\n{}")
    assert p.message.reasoning == "thinking forever and <tool_call>\n{}" and p.message.tool_calls == ()
    assert any("not closed by </think>" in e for e in p.errors)
    p = parse_assistant("r</think>ok<|im_end|>junk")
    assert p.message.content == "ok" and p.ended and any("after <|im_end|>" in e for e in p.errors)
    p = parse_assistant('r</think>\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call> trailing')
    assert len(p.message.tool_calls) == 1 and any("after the last tool call" in e for e in p.errors)
    p = parse_assistant('r</think><tool_call>{"name": "f", "arguments": {}}</tool_call>mid<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert [c.name for c in p.message.tool_calls] == ["f", "g"] and any("between tool calls" in e for e in p.errors)
    p = parse_assistant("")
    assert p.message == Message("assistant", "") and p.errors == ()


def test_parse_assistant_is_lenient_about_whitespace():
    # Generated text need not follow the rendered whitespace exactly.
    p = parse_assistant('<think>plan</think>Answer<tool_call>  {"name":"f","arguments":{"a":1}}  </tool_call>')
    assert p.message.reasoning == "plan" and p.message.content == "Answer" and p.errors == ()
    assert p.message.tool_calls == (ToolCall("call_0_0", "f", '{"a":1}'),)


def test_parsers_never_raise_on_garbage():
    rng = random.Random(123)
    pieces = list(SPECIAL_TOKENS) + list(FRAGMENTS) + ['{"name": "f", "arguments": {}}', "assistant\n", "tool\n", "system\n"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 25)))
        p = parse_assistant(text, turn=rng.randint(0, 5))
        assert p.message.role == "assistant"
        c = parse_conversation(text)
        assert all(isinstance(m, Message) for m in c.messages)


def test_parse_conversation_reports_structure_errors():
    c = parse_conversation("hello")
    assert c.messages == () and "expected <|im_start|>" in c.errors[0]
    c = parse_conversation("<|im_start|>robot\nx<|im_end|>\n<|im_start|>user\ny<|im_end|>\n")
    assert c.messages == (Message("user", "y"),) and "unknown role 'robot'" in c.errors[0]
    c = parse_conversation("<|im_start|>tool\nraw<|im_end|>\n")
    assert c.messages[0].content == "raw" and "not wrapped" in c.errors[0]


# --------------------------------------------------------------------------- bad input
def test_render_rejects_bad_input_with_clear_errors():
    with pytest.raises(TypeError, match=r"messages\[1\]: expected jointrl.records.Message"):
        render([Message("user", "x"), {"role": "user", "content": "y"}])
    with pytest.raises(TypeError, match="messages: expected a sequence"):
        render(Message("user", "x"))
    with pytest.raises(ValueError, match=r"messages\[0\]: unknown role 'robot'"):
        render([Message("robot", "x")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"messages\[0\]: only assistant messages may carry tool_calls"):
        render([Message("user", "x", tool_calls=(ToolCall("a", "f", "{}"),))])
    with pytest.raises(ValueError, match=r"messages\[0\]: only assistant messages may carry reasoning"):
        render([Message("user", "x", reasoning="r")])
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\] \('f'\): arguments are not valid JSON"):
        render([Message("assistant", "", tool_calls=(ToolCall("a", "f", "{oops"),))])
    with pytest.raises(ValueError, match=r"arguments must be a JSON object"):
        render([Message("assistant", "", tool_calls=(ToolCall("a", "f", "[1]"),))])
    with pytest.raises(ValueError, match=r"tool call name must be a non-empty string"):
        render([Message("assistant", "", tool_calls=(ToolCall("a", "", "{}"),))])
    with pytest.raises(ValueError, match=r"tools\[1\]: expected an OpenAI function schema"):
        render([Message("user", "x")], tools=[TOOLS[0], {"type": "function", "function": {}}])
    with pytest.raises(ValueError, match=r"assistant messages can not carry images"):
        render([Message("assistant", "x", images=(b"1",))])
    with pytest.raises(ValueError, match="render_completion: expected an assistant Message"):
        render_completion(Message("user", "x"))


def test_load_tokenizer_checks_ids(tmp_path):
    # A tokenizer whose special ids disagree with the chat format is refused by name.
    bad = tmp_path / "bad"
    shutil.copytree(chat.TOKENIZER_DIR, bad)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        text = (bad / name).read_text(encoding="utf-8")
        (bad / name).write_text(text.replace('"<think>"', '"<thinking>"'), encoding="utf-8")
    with pytest.raises(ValueError, match="'<think>' has id"):
        chat.load_tokenizer(bad)
