"""The Anthropic Messages wire protocol: `/v1/messages` bodies into the internal `ChatRequest`, replies, SSE events, errors.

What it does
- `parse_messages_request`: `system`, `messages` with content blocks (`text`, `thinking`,
  `tool_use`, `tool_result`, and base64 `image` blocks in user turns and tool results, for a checkpoint with a
  vision tower: otherwise a 400 `image_input_unsupported`; a bad image is a 400 `invalid_image`), `tools`, `tool_choice`,
  `thinking`, `stop_sequences`, sampling -> `ChatRequest`. Thinking blocks sent back in history
  become the assistant message's reasoning, so the prompt is the chat format's exact history.
- Thinking tiers: `thinking: {"type": "enabled", "budget_tokens": N}` maps to the nearest tier in
  log distance (the `max` tier, no cap, counts as `max_model_len` tokens); `{"type": "disabled"}` is a
  zero-token budget; `adaptive` / no `thinking` is the default tier. The `thinking_budget` extension
  field (a tier name or a token count, as on the OpenAI route) is accepted too.
- `message_json` (reply with `stop_reason`, `stop_sequence`, `usage`), `sse_events` (Anthropic's event
  sequence: message_start, content_block_start / _delta / _stop per block, message_delta,
  message_stop), `error_body` (Anthropic's error shape).
- `ArgumentTexts`: the exact arguments text the model wrote for a tool call, keyed by the parsed
  object, so a `tool_use.input` sent back renders to the same tokens (token reuse across turns).

What it does not do
- No generation, no prompt caching, no server tools (web search etc.), no assistant prefill.
"""
from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from typing import Any, AsyncIterator, Mapping, Sequence

from jointrl.records import Message, ToolCall
from rl.serve.codec import ServeCodec
from rl.serve.core import (IMAGES_REFUSED, TIERS, ApiError, ChatRequest, Choice, ServeSettings, ToolChoice,
                           bad, base64_image, budget_fields, check_limits, check_model, is_int, merge_extra_body, parse_max_tokens, request_image,
                           sampling_numbers, thinking_signature)
from rl.serve.service import Finished, Prepared, TextDelta

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
MAX_STOP_SEQUENCES = 16


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class ArgumentTexts:
    """LRU: canonical JSON of a tool call's arguments -> the text the model wrote (thread-safe)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(obj: Any) -> str:
        return json.dumps(obj, sort_keys=True, ensure_ascii=False)

    def remember(self, text: str) -> None:
        with self._lock:
            k = self._key(json.loads(text))
            self._d[k] = text
            self._d.move_to_end(k)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def text_for(self, obj: Mapping[str, Any]) -> str:
        with self._lock:
            return self._d.get(self._key(obj)) or json.dumps(obj, ensure_ascii=False)


# ============================================================================ request parsing
def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content blocks, got {type(content).__name__}", f"{where}.content")
    for j, b in enumerate(content):
        if not isinstance(b, Mapping) or not isinstance(b.get("type"), str):
            raise bad(f"{where}.content[{j}] must be an object with a 'type'", f"{where}.content")
    return content


def _image(b: Mapping[str, Any], where: str, codec: ServeCodec, param: str) -> bytes:
    """A base64 `image` block -> checked image bytes (URL sources are refused: the server fetches nothing)."""
    if codec.vision is None or codec.max_images == 0:
        raise ApiError(400, f"{where}: {IMAGES_REFUSED}", param=param, code="image_input_unsupported")
    src = b.get("source")
    if not isinstance(src, Mapping) or src.get("type") != "base64":
        raise bad(f"{where}.source must be {{'type': 'base64', 'media_type': 'image/png', 'data': ...}} (URL sources are not "
                  "accepted)", param, "image_url_unsupported")
    return request_image(base64_image(src.get("data"), f"{where}.source.data", param), codec, where, param)


def _text(b: Mapping[str, Any], where: str) -> str:
    if not isinstance(b.get("text"), str):
        raise bad(f"{where}.text must be a string", where)
    return b["text"]


def _tool_result(b: Mapping[str, Any], where: str, codec: ServeCodec) -> tuple[str, tuple[bytes, ...]]:
    content = b.get("content", "")
    if content is None:
        content = ""
    parts = [content] if isinstance(content, str) else None
    images: list[bytes] = []
    if parts is None:
        parts = []
        for j, c in enumerate(_blocks(content, where)):
            if c["type"] == "image":
                images.append(_image(c, f"{where}.content[{j}]", codec, f"{where}.content"))
                continue
            if c["type"] != "text":
                raise bad(f"{where}.content[{j}]: tool_result blocks of type {c['type']!r} are not supported (text, image)", f"{where}.content")
            parts.append(_text(c, f"{where}.content[{j}]"))
    text = "".join(parts)
    return (f"error: {text}" if b.get("is_error") is True else text), tuple(images)


def _user_messages(blocks: Sequence[Mapping[str, Any]], where: str, codec: ServeCodec) -> list[Message]:
    out: list[Message] = []
    texts: list[str] = []
    images: list[bytes] = []  # shown before the text of the user message they arrive in (model/chat.py)

    def flush() -> None:
        if texts or images:
            out.append(Message(role="user", content=codec.defuse("".join(texts)), images=tuple(images)))
            texts.clear()
            images.clear()

    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        if b["type"] == "text":
            texts.append(_text(b, w))
        elif b["type"] == "image":
            images.append(_image(b, w, codec, f"{where}.content"))
        elif b["type"] == "tool_result":
            flush()
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{w}.tool_use_id must be a string", f"{w}.tool_use_id")
            text, pics = _tool_result(b, w, codec)
            out.append(Message(role="tool", content=codec.defuse(text), tool_call_id=b["tool_use_id"], images=pics))
        else:
            raise bad(f"{w}: user content blocks of type {b['type']!r} are not supported (text, image, tool_result)", f"{where}.content")
    flush()
    return out


def _assistant_message(blocks: Sequence[Mapping[str, Any]], where: str, args: ArgumentTexts | None) -> Message:
    reasoning, texts, calls = [], [], []
    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        t = b["type"]
        if t == "text":
            texts.append(_text(b, w))
        elif t == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise bad(f"{w}.thinking must be a string", f"{w}.thinking")
            reasoning.append(b["thinking"])
        elif t == "tool_use":
            name, inp = b.get("name"), b.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad(f"{w}.name must be a non-empty string", f"{w}.name")
            if not isinstance(inp, Mapping):
                raise bad(f"{w}.input must be an object", f"{w}.input")
            text = args.text_for(inp) if args is not None else json.dumps(inp, ensure_ascii=False)
            calls.append(ToolCall(id=str(b.get("id") or ""), name=name, arguments=text))
        elif t == "redacted_thinking":
            raise bad(f"{w}: redacted_thinking blocks are not supported (this server never redacts thinking)", f"{where}.content")
        else:
            raise bad(f"{w}: assistant content blocks of type {t!r} are not supported (text, thinking, tool_use)", f"{where}.content")
    return Message(role="assistant", content="".join(texts), tool_calls=tuple(calls), reasoning="".join(reasoning) or None)


def _system(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(b, Mapping) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in raw):
        return "".join(b["text"] for b in raw)
    raise bad("system must be a string or a list of text blocks", "system")


def _tools(raw: Any) -> tuple[Mapping[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad("tools must be a list of {'name', 'description', 'input_schema'} objects", "tools")
    out = []
    for j, t in enumerate(raw):
        if not isinstance(t, Mapping):
            raise bad(f"tools[{j}] must be an object", f"tools[{j}]")
        if t.get("type") not in (None, "custom"):
            raise bad(f"tools[{j}]: server tools (type {t.get('type')!r}) are not supported; define client tools with input_schema", f"tools[{j}]")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad(f"tools[{j}].name must be a non-empty string", f"tools[{j}].name")
        if not isinstance(schema, Mapping):
            raise bad(f"tools[{j}].input_schema must be a JSON schema object", f"tools[{j}].input_schema")
        # OpenAI's key order (name, description, parameters): a template renders the same tool the same way from either route.
        fn: dict[str, Any] = {"name": name}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = dict(schema)
        out.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad(f"tools: duplicate names {dup}", "tools")
    return tuple(out) or None


def _tool_choice(raw: Any, tools: tuple[Mapping[str, Any], ...] | None) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'} ('tool' with a 'name')", "tool_choice")
    if kind != "none" and not tools:
        raise bad(f"tool_choice {kind!r} needs a non-empty 'tools' list", "tool_choice")
    if kind == "tool":
        names = [t["function"]["name"] for t in tools or ()]
        if raw.get("name") not in names:
            raise bad(f"tool_choice names tool {raw.get('name')!r}, which is not in tools {names}", "tool_choice")
        return ToolChoice("function", raw["name"])
    return ToolChoice({"auto": "auto", "any": "required", "none": "none"}[kind])  # type: ignore[arg-type]


def nearest_tier(budget_tokens: int, settings: ServeSettings) -> str:
    """The tier whose budget is nearest in log distance; `max` (no cap) counts as max_model_len tokens. Ties go to the lower tier."""
    def size(t: str) -> float:
        n = settings.tier_budget(t)
        return float(settings.max_model_len if n is None else max(n, 1))

    x = math.log(max(budget_tokens, 1))
    return min(TIERS, key=lambda t: (abs(math.log(size(t)) - x), TIERS.index(t)))


def _thinking(body: Mapping[str, Any], settings: ServeSettings) -> tuple[str | None, int | None]:
    raw = body.get("thinking")
    ext = body.get("thinking_budget", body.get("reasoning_effort"))
    from_ext = None
    if body.get("thinking_budget") is not None or body.get("reasoning_effort") is not None:
        tier, budget, _ = budget_fields(body, settings)  # the OpenAI route's own validation
        from_ext = (tier, budget)
    if raw is None:
        return from_ext or (settings.default_tier, settings.tier_budget(settings.default_tier))
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'disabled'} or {'type': 'adaptive'}", "thinking")
    if raw.get("display") not in (None, "summarized"):
        raise bad(f"thinking.display {raw.get('display')!r} is not supported (thinking is always returned in full)", "thinking.display")
    if kind == "enabled":
        n = raw.get("budget_tokens")
        if not is_int(n) or n < 1:
            raise bad(f"thinking.budget_tokens must be an integer >= 1, got {n!r}", "thinking.budget_tokens")
        tier = nearest_tier(n, settings)
        got = (tier, settings.tier_budget(tier))
    elif kind == "disabled":
        got = (None, 0)  # a zero budget closes thinking at once (a format without a thinking block has none: no cap)
    else:
        got = (settings.default_tier, settings.tier_budget(settings.default_tier))
    if from_ext is not None and from_ext[1] != got[1]:
        raise bad(f"thinking {dict(raw)!r} and the thinking_budget extension {ext!r} ask for different budgets; send one", "thinking_budget")
    return from_ext or got


def parse_messages_request(body: Any, settings: ServeSettings, model_names: Sequence[str], codec: ServeCodec,
                           args: ArgumentTexts | None = None, count_only: bool = False) -> ChatRequest:
    """Validate a decoded `/v1/messages` (or `count_tokens`) body; every problem is an ApiError naming the field."""
    if not isinstance(body, Mapping):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    body = merge_extra_body(body)
    model = check_model(body.get("model"), model_names)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    max_tokens = body.get("max_tokens")
    if not count_only:
        if max_tokens is None:
            raise bad("max_tokens is required", "max_tokens", "missing_required_parameter")
        parse_max_tokens(max_tokens, "max_tokens")
    check_limits(len(raw_messages), max_tokens, settings, "max_tokens")
    messages: list[Message] = []
    system = _system(body.get("system"))
    if system:
        messages.append(Message(role="system", content=codec.defuse(system)))
    for i, m in enumerate(raw_messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where} must be an object with role 'user' or 'assistant'", f"{where}.role")
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "user":
            messages += _user_messages(blocks, where, codec)
        else:
            messages.append(_assistant_message(blocks, where, args))
    if raw_messages[-1].get("role") == "assistant":
        raise bad("the last message is from the assistant; this server does not continue a partial assistant message (prefill)",
                  f"messages[{len(raw_messages) - 1}].role")
    if not messages or messages[-1].role not in ("user", "tool"):
        raise bad("the conversation must end with user text or a tool_result", "messages")
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    tier, budget = _thinking(body, settings)
    default_budget = body.get("thinking") is None and body.get("thinking_budget") is None and body.get("reasoning_effort") is None
    temperature, top_p = sampling_numbers(body, max_temperature=1.0)
    if body.get("top_k") is not None:
        raise bad("top_k is not supported by this server", "top_k")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_SEQUENCES:
        raise bad(f"stop_sequences must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings", "stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad(f"stream must be a boolean, got {stream!r}", "stream")
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, Mapping):
        raise bad("metadata must be an object", "metadata")
    user = meta.get("user_id") if meta else None
    return ChatRequest(
        model=model, messages=tuple(messages), raw_messages=tuple(raw_messages), tools=tools, tool_choice=tool_choice,
        tier=tier, thinking_budget=budget, max_tokens=max_tokens if is_int(max_tokens) else None, temperature=float(temperature),
        top_p=float(top_p), stop=tuple(stops), stream=bool(stream), user=user if isinstance(user, str) else None,
        metadata=dict(meta) if meta else None, protocol="anthropic", raw_system=body.get("system"), default_budget=default_budget,
    )


# ============================================================================ replies
def _stop_reason(c: Choice) -> str:
    if c.finish_reason == "tool_calls":
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop_string is not None else "end_turn"


def _usage(prep: Prepared, c: Choice) -> dict[str, Any]:
    return {"input_tokens": prep.n_prompt, "output_tokens": len(c.completion.token_ids), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens_details": {"thinking_tokens": c.reasoning_tokens}}


def _tool_blocks(c: Choice, args: ArgumentTexts | None) -> list[dict[str, Any]]:
    out = []
    for tc in c.message.tool_calls:
        if args is not None:
            args.remember(tc.arguments)
        out.append({"type": "tool_use", "id": tc.id, "name": tc.name, "input": json.loads(tc.arguments)})
    return out


def message_json(prep: Prepared, c: Choice, args: ArgumentTexts | None = None) -> dict[str, Any]:
    m = c.message
    content: list[dict[str, Any]] = []
    if m.reasoning:
        content.append({"type": "thinking", "thinking": m.reasoning, "signature": thinking_signature(m.reasoning)})
    if m.content or not m.tool_calls:
        content.append({"type": "text", "text": m.content})
    content += _tool_blocks(c, args)
    return {"id": prep.id, "type": "message", "role": "assistant", "model": prep.req.model, "content": content,
            "stop_reason": _stop_reason(c), "stop_sequence": c.stop_string, "usage": _usage(prep, c),
            "parse_errors": list(c.parse_errors)}


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(prep: Prepared, events: AsyncIterator[TextDelta | Finished], args: ArgumentTexts | None = None) -> AsyncIterator[bytes]:
    """Anthropic's streaming event sequence, sent as the service produces text.

    Blocks in order: thinking (closed with its signature when the answer starts), text, then the
    tool_use blocks (their input as one input_json_delta) once the reply is parsed.
    """
    req = prep.req
    yield _event("message_start", {"type": "message_start", "message": {
        "id": prep.id, "type": "message", "role": "assistant", "model": req.model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": prep.n_prompt, "output_tokens": 0}}})
    index, open_kind, thinking = -1, None, []

    def close() -> list[bytes]:
        out = []
        if open_kind == "thinking":
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                      "delta": {"type": "signature_delta", "signature": thinking_signature("".join(thinking))}}))
        if open_kind is not None:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out

    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                kind = "thinking" if ev.field == "reasoning" else "text"
                if kind == "thinking" and open_kind == "text":
                    continue  # cannot reopen the thinking block; the finished message is in the record
                if kind != open_kind:
                    for b in close():
                        yield b
                    index, open_kind = index + 1, kind
                    block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
                    yield _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})
                if kind == "thinking":
                    thinking.append(ev.text)
                    delta = {"type": "thinking_delta", "thinking": ev.text}
                else:
                    delta = {"type": "text_delta", "text": ev.text}
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                continue
            c = ev.choices[0]
            if open_kind is None and not c.message.tool_calls:  # an empty reply still has one (empty) text block
                index, open_kind = 0, "text"
                yield _event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
            for b in close():
                yield b
            open_kind = None
            for block in _tool_blocks(c, args):
                index += 1
                yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": {**block, "input": {}}})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            usage = _usage(prep, c)
            yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": _stop_reason(c), "stop_sequence": c.stop_string},
                                           "usage": {"output_tokens": usage["output_tokens"], "output_tokens_details": usage["output_tokens_details"]}})
    except ApiError as e:
        yield _event("error", error_body(e))
        return
    yield _event("message_stop", {"type": "message_stop"})
