"""The OpenAI Responses wire protocol (`POST /v1/responses`): input items into the internal `ChatRequest`, replies, SSE events.

What it does
- `parse_responses_request`: `input` (a string, or items: messages with `input_text` / `output_text` /
  `input_image` parts, `function_call`, `function_call_output`, `reasoning`), `instructions` (the system
  message), function `tools`, `tool_choice`, `reasoning.effort` (the efforts of rl/serve/settings.py
  `EFFORTS`), `max_output_tokens`, sampling, `stream`, `previous_response_id` -> `ChatRequest`, or an
  ApiError naming the field.
- Turns are rebuilt as the chat format renders them: the assistant-side items between two user / tool
  items (reasoning, text, function calls) are one assistant turn, so a reasoning item sent back is that
  turn's thinking in the next prompt, exactly where the model wrote it (and token reuse applies).
  A reasoning item's text comes from its `content`, else from the `encrypted_content` this server wrote
  (the text, base64: nothing is encrypted; it lets a client that keeps no content send thinking back),
  else from its `summary`.
- `ResponseStore`: stored responses (`store`, default true) by id, an LRU of the conversation up to and
  including each reply; `previous_response_id` continues one (instructions are not carried over, as in
  OpenAI's API). Unknown or evicted ids are a 404.
- `response_json` (the reply object: `output` items reasoning / message / function_call, `status`
  completed or incomplete, `usage` with reasoning tokens) and `sse_events` (response.created,
  output_item.added / done, content_part.added / done, reasoning_text / output_text / function_call_arguments
  deltas, response.completed or response.incomplete), sent as the service produces text.

What it does not do
- No hosted tools (web search, file search, computer use), no background mode, no conversations API,
  no item_reference, no structured text formats, no `top_logprobs` (the chat-completions route has them).
- No generation: `rl.serve.service` runs the request.
"""
from __future__ import annotations

import base64
import binascii
import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping, Sequence

from jointrl.records import Message, ToolCall
from rl.serve.codec import ServeCodec
from rl.serve.core import (ApiError, ChatRequest, Choice, ServeSettings, ToolChoice, brief, bad, budget_fields, check_limits, check_model,
                           is_int, merge_extra_body, parse_budget_value, parse_max_tokens, parse_seed, sampling_numbers)
from rl.serve.service import Finished, Prepared, TextDelta

ENCRYPTED_PREFIX = "jointrl-reasoning:"  # `encrypted_content` = this + base64(text): opaque to clients, readable here


# ============================================================================ stored responses
class ResponseStore:
    """LRU: response id -> the conversation up to and including that reply (thread-safe)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, tuple[Message, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: Sequence[Message]) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._d[rid] = tuple(messages)
            self._d.move_to_end(rid)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def get(self, rid: str) -> tuple[Message, ...] | None:
        with self._lock:
            got = self._d.get(rid)
            if got is not None:
                self._d.move_to_end(rid)
            return got


@dataclass(frozen=True)
class ResponsesCall:
    """A parsed /v1/responses request: the internal request plus what the reply echoes and the store needs."""

    req: ChatRequest
    history: tuple[Message, ...]  # the conversation without the instructions (what a stored reply extends)
    store: bool
    instructions: str | None
    previous_response_id: str | None
    effort: str | None
    tools_json: tuple[Mapping[str, Any], ...]  # the tools as sent (echoed in the reply)
    tool_choice_json: Any
    include_encrypted: bool


# ============================================================================ request parsing
def _text_parts(content: Any, where: str, codec: ServeCodec, allow_images: bool) -> tuple[str, tuple[bytes, ...]]:
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    texts, images = [], []
    for j, part in enumerate(content):
        w = f"{where}.content[{j}]"
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise bad(f"{w} must be an object with a 'type'", f"{where}.content")
        kind = part["type"]
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise bad(f"{w}.text must be a string", f"{where}.content")
            texts.append(text)
        elif kind == "input_image" and allow_images:
            from rl.serve.openai import _data_url_image

            images.append(_data_url_image(part, w, codec, f"{where}.content"))
        else:
            raise bad(f"{w}: content parts of type {brief(kind)} are not supported here (input_text, output_text, input_image in "
                      "user messages)", f"{where}.content")
    return "".join(texts), tuple(images)


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, list) and content:
        parts = [p.get("text") for p in content if isinstance(p, Mapping)]
        if not all(isinstance(t, str) for t in parts) or len(parts) != len(content):
            raise bad(f"{where}.content must be a list of {{'type': 'reasoning_text', 'text': ...}}", f"{where}.content")
        return "".join(parts)
    enc = item.get("encrypted_content")
    if isinstance(enc, str) and enc.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(enc[len(ENCRYPTED_PREFIX):], validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            raise bad(f"{where}.encrypted_content is not one this server wrote", f"{where}.encrypted_content") from None
    summary = item.get("summary", [])
    if not isinstance(summary, list) or not all(isinstance(p, Mapping) and isinstance(p.get("text"), str) for p in summary):
        raise bad(f"{where}.summary must be a list of {{'type': 'summary_text', 'text': ...}}", f"{where}.summary")
    return "\n".join(p["text"] for p in summary)


class _Turns:
    """Builds messages from input items; assistant-side items gather into one assistant turn."""

    def __init__(self, codec: ServeCodec) -> None:
        self.codec = codec
        self.messages: list[Message] = []
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._calls: list[ToolCall] = []

    def flush(self) -> None:
        if self._reasoning or self._text or self._calls:
            self.messages.append(Message(role="assistant", content="".join(self._text), tool_calls=tuple(self._calls),
                                         reasoning="\n".join(self._reasoning) or None))
            self._reasoning, self._text, self._calls = [], [], []

    def add(self, item: Any, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "developer":
                role = "system"
            if role not in ("user", "system", "assistant"):
                raise bad(f"{where}.role {brief(role)} is not one of 'user', 'system', 'developer', 'assistant'", f"{where}.role")
            text, images = _text_parts(item.get("content"), where, self.codec, allow_images=role == "user")
            if role == "assistant":
                self._text.append(text)
                return
            self.flush()
            self.messages.append(Message(role=role, content=self.codec.defuse(text), images=images))
        elif kind == "reasoning":
            if self._text or self._calls:  # thinking comes first in a turn: this one starts the next turn
                self.flush()
            self._reasoning.append(_reasoning_text(item, where))
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not name:
                raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            if not isinstance(args, str):
                raise bad(f"{where}.arguments must be a JSON string", f"{where}.arguments")
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):
                parsed = None
            if not isinstance(parsed, dict):
                raise bad(f"{where}.arguments must be a JSON object string, got {brief(args)}", f"{where}.arguments")
            self._calls.append(ToolCall(id=call_id, name=name, arguments=args))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            if isinstance(output, str):
                text, images = output, ()
            else:
                text, images = _text_parts(output, f"{where}.output", self.codec, allow_images=True)
            self.flush()
            self.messages.append(Message(role="tool", content=self.codec.defuse(text), tool_call_id=call_id, images=images))
        else:
            raise bad(f"{where}: input items of type {brief(kind)} are not supported (message, function_call, function_call_output, "
                      "reasoning)", f"{where}.type")


def _tools(raw: Any) -> tuple[tuple[Mapping[str, Any], ...] | None, tuple[Mapping[str, Any], ...]]:
    if raw is None:
        return None, ()
    if not isinstance(raw, list):
        raise bad("tools must be a list of {'type': 'function', 'name', 'parameters'} objects", "tools")
    out = []
    for j, t in enumerate(raw):
        if not isinstance(t, Mapping) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, Mapping) else None
            raise bad(f"tools[{j}]: only function tools are supported (hosted tools such as {brief(kind)} are not)", f"tools[{j}]")
        name, params = t.get("name"), t.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad(f"tools[{j}].name must be a non-empty string", f"tools[{j}].name")
        if params is not None and not isinstance(params, Mapping):
            raise bad(f"tools[{j}].parameters must be a JSON schema object", f"tools[{j}].parameters")
        fn: dict[str, Any] = {"name": name}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = dict(params) if params is not None else {"type": "object", "properties": {}}
        if t.get("strict") is not None:
            if not isinstance(t["strict"], bool):
                raise bad(f"tools[{j}].strict must be a boolean", f"tools[{j}].strict")
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad(f"tools: duplicate names {dup}", "tools")
    return (tuple(out) or None), tuple(raw)


def _tool_choice(raw: Any, tools: tuple[Mapping[str, Any], ...] | None) -> ToolChoice:
    names = [t["function"]["name"] for t in tools or ()]
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("auto", "none", "required"):
        if raw != "none" and not tools:
            raise bad(f"tool_choice {raw!r} needs a non-empty 'tools' list", "tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        if raw.get("name") not in names:
            raise bad(f"tool_choice names function {brief(raw.get('name'))}, which is not in tools {names}", "tool_choice")
        return ToolChoice("function", raw["name"])
    raise bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _effort(body: Mapping[str, Any], settings: ServeSettings) -> tuple[str | None, int | None, bool, str | None]:
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise bad("reasoning must be an object {'effort': ..., 'summary': ...}", "reasoning")
    effort = (reasoning or {}).get("effort")
    tier, budget, default = budget_fields(body, settings)  # thinking_budget / reasoning_effort, as on the other routes
    if effort is None:
        return tier, budget, default, None
    got = parse_budget_value(effort, "reasoning.effort", settings)
    if not default and got != (tier, budget):
        raise bad("reasoning.effort and thinking_budget / reasoning_effort ask for different budgets; send one", "reasoning.effort")
    return got[0], got[1], False, effort


def parse_responses_request(body: Any, settings: ServeSettings, model_names: Sequence[str], codec: ServeCodec,
                            store: ResponseStore) -> ResponsesCall:
    """Validate a decoded /v1/responses body; every problem is an ApiError naming the field."""
    if not isinstance(body, Mapping):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    body = merge_extra_body(body)
    model = check_model(body.get("model"), model_names)
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        raw_items: list[Any] = [{"type": "message", "role": "user", "content": raw_input}]
    elif isinstance(raw_input, list) and raw_input:
        raw_items = raw_input
    else:
        raise bad("input must be a string or a non-empty list of input items", "input", "missing_required_parameter" if raw_input is None else None)
    max_tokens = parse_max_tokens(body.get("max_output_tokens"), "max_output_tokens")
    check_limits(len(raw_items), max_tokens, settings, "max_output_tokens")
    prev_id = body.get("previous_response_id")
    history: tuple[Message, ...] = ()
    if prev_id is not None:
        if not isinstance(prev_id, str):
            raise bad("previous_response_id must be a string", "previous_response_id")
        got = store.get(prev_id)
        if got is None:
            raise ApiError(404, f"previous response {brief(prev_id)} is not stored on this server (unknown, evicted, or sent with "
                                "store: false); send the conversation as input instead", param="previous_response_id",
                           code="previous_response_not_found")
        history = got
    turns = _Turns(codec)
    for i, item in enumerate(raw_items):
        turns.add(item, i)
    turns.flush()
    history = history + tuple(turns.messages)
    if len(history) > settings.max_messages:
        raise bad(f"the conversation has {len(history)} messages; this server accepts at most {settings.max_messages} (--max-messages)",
                  "input", "too_many_messages")
    if not history or history[-1].role not in ("user", "tool", "system"):
        raise bad("the conversation must end with a user message or a function_call_output (no assistant prefill)", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    messages = ((Message(role="system", content=codec.defuse(instructions)),) if instructions else ()) + history
    tools, tools_json = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    tier, budget, default_budget, effort = _effort(body, settings)
    temperature, top_p = sampling_numbers(body, max_temperature=2.0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad(f"stream must be a boolean, got {brief(stream)}", "stream")
    store_flag = body.get("store", True)
    if not isinstance(store_flag, bool) and store_flag is not None:
        raise bad("store must be a boolean", "store")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if text is not None and not (isinstance(text, Mapping) and (fmt is None or (isinstance(fmt, Mapping) and fmt.get("type") == "text"))):
        raise bad("text.format other than {'type': 'text'} (JSON schema outputs) is not supported by this server", "text")
    for key in ("background", "conversation", "prompt"):
        if body.get(key):
            raise bad(f"{key} is not supported by this server", key)
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs is not supported on /v1/responses; /v1/chat/completions returns them", "top_logprobs")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("include must be a list of strings", "include")
    meta, user = body.get("metadata"), body.get("user")
    if meta is not None and not isinstance(meta, Mapping):
        raise bad("metadata must be an object", "metadata")
    req = ChatRequest(
        model=model, messages=messages, raw_messages=tuple(raw_items), tools=tools, tool_choice=tool_choice, tier=tier,
        thinking_budget=budget, max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), seed=parse_seed(body.get("seed")),
        stream=bool(stream), user=user if isinstance(user, str) else None, metadata=dict(meta) if meta else None, protocol="responses",
        raw_system=instructions, default_budget=default_budget)
    return ResponsesCall(req=req, history=history, store=store_flag is not False, instructions=instructions, previous_response_id=prev_id,
                         effort=effort, tools_json=tools_json, tool_choice_json=body.get("tool_choice", "auto"),
                         include_encrypted="reasoning.encrypted_content" in include)


# ============================================================================ replies
@dataclass(frozen=True)
class ItemIds:
    """Ids of a reply's output items, fixed before streaming so the stream and the final object agree."""

    reasoning: str
    message: str
    calls: str  # prefix; the i-th call is f"{calls}_{i}"

    @staticmethod
    def new() -> "ItemIds":
        h = uuid.uuid4().hex[:24]
        return ItemIds(f"rs_{h}", f"msg_{h}", f"fc_{h}")


def reasoning_item(ids: ItemIds, text: str, call: ResponsesCall) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "id": ids.reasoning, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
                            "status": "completed"}
    if call.include_encrypted:
        item["encrypted_content"] = ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8")).decode("ascii")
    return item


def message_item(ids: ItemIds, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": ids.message, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_items(ids: ItemIds, c: Choice) -> list[dict[str, Any]]:
    return [{"type": "function_call", "id": f"{ids.calls}_{j}", "call_id": tc.id, "name": tc.name, "arguments": tc.arguments,
             "status": "completed"} for j, tc in enumerate(c.message.tool_calls)]


def output_items(ids: ItemIds, c: Choice, call: ResponsesCall, with_reasoning: bool = True) -> list[dict[str, Any]]:
    m = c.message
    out = []
    if m.reasoning and with_reasoning:
        out.append(reasoning_item(ids, m.reasoning, call))
    if m.content or not m.tool_calls:
        out.append(message_item(ids, m.content))
    return out + call_items(ids, c)


def response_json(prep: Prepared, call: ResponsesCall, c: Choice | None, output: list[dict[str, Any]], status: str | None = None) -> dict[str, Any]:
    req = prep.req
    if status is None:
        status = "incomplete" if c is not None and c.finish_reason == "length" else "completed"
    n_out = len(c.completion.token_ids) if c is not None else 0
    return {
        "id": prep.id, "object": "response", "created_at": prep.created, "status": status, "model": req.model, "output": output,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": call.instructions, "max_output_tokens": req.max_tokens, "previous_response_id": call.previous_response_id,
        "parallel_tool_calls": True, "reasoning": {"effort": call.effort, "summary": None}, "store": call.store,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": call.tool_choice_json, "tools": list(call.tools_json),
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": dict(req.metadata or {}), "user": req.user,
        "usage": None if c is None else {
            "input_tokens": prep.n_prompt, "input_tokens_details": {"cached_tokens": prep.prompt.reused},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
            "total_tokens": prep.n_prompt + n_out},
    }


def remember(store: ResponseStore, prep: Prepared, call: ResponsesCall, c: Choice) -> None:
    """Keep the conversation up to this reply for `previous_response_id` (when the request allowed it)."""
    if call.store:
        store.put(prep.id, call.history + (c.message,))


def _event(kind: str, seq: list[int], data: Mapping[str, Any]) -> bytes:
    seq[0] += 1
    body = {"type": kind, "sequence_number": seq[0], **data}
    return f"event: {kind}\ndata: ".encode() + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(prep: Prepared, call: ResponsesCall, events: AsyncIterator[TextDelta | Finished], store: ResponseStore) -> AsyncIterator[bytes]:
    """The Responses streaming event sequence, sent as the service produces text: a reasoning item (its text
    as reasoning_text deltas), a message item (output_text deltas), then each function call (its arguments
    as one delta) when the reply is parsed, and response.completed (or response.incomplete)."""
    ids, seq = ItemIds.new(), [-1]
    yield _event("response.created", seq, {"response": response_json(prep, call, None, [], "in_progress")})
    yield _event("response.in_progress", seq, {"response": response_json(prep, call, None, [], "in_progress")})
    index, open_kind, texts, done_items = -1, None, {"reasoning": "", "content": ""}, []

    def open_item(kind: str) -> list[bytes]:
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        if kind == "reasoning":
            item = {"type": "reasoning", "id": ids.reasoning, "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {**message_item(ids, "", "in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item_id = ids.reasoning if kind == "reasoning" else ids.message
        return [_event("response.output_item.added", seq, {"output_index": index, "item": item}),
                _event("response.content_part.added", seq, {"item_id": item_id, "output_index": index, "content_index": 0, "part": part})]

    def close_item() -> list[bytes]:
        nonlocal open_kind
        if open_kind is None:
            return []
        kind, open_kind = open_kind, None
        text = texts[kind]
        if kind == "reasoning":
            item, part = reasoning_item(ids, text, call), {"type": "reasoning_text", "text": text}
            out = [_event("response.reasoning_text.done", seq, {"item_id": ids.reasoning, "output_index": index, "content_index": 0, "text": text})]
        else:
            item, part = message_item(ids, text), {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = [_event("response.output_text.done", seq, {"item_id": ids.message, "output_index": index, "content_index": 0, "text": text,
                                                              "logprobs": []})]
        done_items.append(item)
        return out + [_event("response.content_part.done", seq, {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part}),
                      _event("response.output_item.done", seq, {"output_index": index, "item": item})]

    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                if ev.field == "reasoning" and (open_kind == "content" or texts["content"]):
                    continue  # an item cannot reopen; the finished reply is recorded whole
                if ev.field != open_kind:
                    for b in close_item() + open_item(ev.field):
                        yield b
                texts[ev.field] += ev.text
                if ev.field == "reasoning":
                    yield _event("response.reasoning_text.delta", seq, {"item_id": ids.reasoning, "output_index": index, "content_index": 0,
                                                                        "delta": ev.text})
                else:
                    yield _event("response.output_text.delta", seq, {"item_id": ids.message, "output_index": index, "content_index": 0,
                                                                     "delta": ev.text, "logprobs": []})
                continue
            c = ev.choices[0]
            if not texts["content"] and open_kind != "content" and not c.message.tool_calls:
                for b in close_item() + open_item("content"):  # an empty answer is still one (empty) message
                    yield b
            for b in close_item():
                yield b
            for item in call_items(ids, c):
                index += 1
                yield _event("response.output_item.added", seq, {"output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}})
                yield _event("response.function_call_arguments.delta", seq, {"item_id": item["id"], "output_index": index, "delta": item["arguments"]})
                yield _event("response.function_call_arguments.done", seq, {"item_id": item["id"], "output_index": index, "name": item["name"],
                                                                            "arguments": item["arguments"]})
                yield _event("response.output_item.done", seq, {"output_index": index, "item": item})
                done_items.append(item)
            remember(store, prep, call, c)
            final = response_json(prep, call, c, done_items)
            yield _event("response.completed" if final["status"] == "completed" else "response.incomplete", seq, {"response": final})
    except ApiError as e:
        yield _event("error", seq, {"code": e.code, "message": e.message, "param": e.param})
