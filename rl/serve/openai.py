"""The OpenAI chat-completions wire protocol: request parsing into the internal `ChatRequest`, replies, SSE chunks.

What it does
- `parse_chat_request`: a decoded `/v1/chat/completions` body -> `ChatRequest`, or ApiError naming
  the field. `extra_body` sent as raw JSON (`{"extra_body": {"thinking_budget": "max"}}`, the form
  the openai client flattens) is honoured like the same keys at the top level.
- `completion_json`: a finished reply; `sse_events`: the streamed reply, chunk by chunk as the
  service produces text (`chat.completion.chunk` objects, then `data: [DONE]`).
- `stream_chunks`: the chunk sequence of an already finished reply (the same deltas joined).

What it does not do
- Images: `image_url` / `input_image` parts with base64 data URLs reach the model (checkpoints with a vision
  tower); bad images are a 400 `invalid_image`, and a server that takes no images answers 400
  `image_input_unsupported`.
- No generation: `rl.serve.service` runs the request.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

from jointrl.records import Message, ToolCall
from rl.serve.codec import ServeCodec
from rl.serve.core import (IMAGES_REFUSED, MAX_TOP_LOGPROBS, ApiError, ChatRequest, Choice, ServeSettings, TokenizerLike, ToolChoice,
                           brief, bad, base64_image, check_limits, check_model, is_int, merge_extra_body, budget_fields,
                           parse_max_tokens, parse_seed, request_image, sampling_numbers)
from rl.serve.records import message_json  # the reply message on the wire is the recorded one
from rl.serve.service import Finished, Prepared, TextDelta

def _data_url_image(part: Mapping[str, Any], where: str, codec: ServeCodec, param: str) -> bytes:
    """An `image_url` / `input_image` part's data URL -> checked image bytes. Only data URLs: the server
    fetches nothing from the network on a client's behalf."""
    if codec.vision is None or codec.max_images == 0:
        raise ApiError(400, f"{where}: {IMAGES_REFUSED}", param=param, code="image_input_unsupported")
    url = part.get("image_url")
    if isinstance(url, Mapping):
        url = url.get("url")
    if not isinstance(url, str):
        raise bad(f"{where}.image_url must be a data URL string or {{'url': data URL}}", param, "invalid_image")
    head, sep, data = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise bad(f"{where}: only base64 data URLs (data:image/png;base64,...) are accepted; got {url[:40]!r}", param,
                  "image_url_unsupported")
    return request_image(base64_image(data, where, param), codec, where, param)


def _content(content: Any, where: str, codec: ServeCodec) -> tuple[str, tuple[bytes, ...]]:
    """OpenAI content (a string, null or a list of text and image parts) -> (text, images). The images are
    shown before the text (model/chat.py places them so), in the order sent."""
    if content is None:
        return "", ()
    if isinstance(content, str):
        return content, ()
    if isinstance(content, list):
        out, images = [], []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise bad(f"{where}.content[{j}] must be an object with a 'type'", f"{where}.content")
            if part["type"] in ("image_url", "image", "input_image"):
                images.append(_data_url_image(part, f"{where}.content[{j}]", codec, f"{where}.content"))
                continue
            if part["type"] != "text":
                raise bad(f"{where}.content[{j}]: content parts of type {part['type']!r} are not supported "
                           "by this server (text only)", f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}].text must be a string", f"{where}.content")
            out.append(part["text"])
        return "".join(out), tuple(images)
    raise bad(f"{where}.content must be a string, null or a list of text parts, got {type(content).__name__}",
               f"{where}.content")


def _parse_tool_call(d: Any, where: str) -> ToolCall:
    if not isinstance(d, Mapping):
        raise bad(f"{where} must be an object", where)
    fn = d.get("function")
    if not isinstance(fn, Mapping):
        raise bad(f"{where}.function must be an object with 'name' and 'arguments'", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if args is None:
        args = "{}"
    if isinstance(args, Mapping):
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise bad(f"{where}.function.arguments must be a JSON string", f"{where}.function.arguments")
    try:
        parsed = json.loads(args)
    except ValueError as e:
        raise bad(f"{where}.function.arguments is not valid JSON ({e}): {args[:200]!r}", f"{where}.function.arguments") from None
    if not isinstance(parsed, dict):
        raise bad(f"{where}.function.arguments must be a JSON object, got {args[:200]!r}", f"{where}.function.arguments")
    call_id = d.get("id", "")
    return ToolCall(id=str(call_id or ""), name=name, arguments=args)


def parse_message(d: Any, i: int, codec: ServeCodec) -> Message:
    """One OpenAI message dict -> `Message`, or ApiError naming what is wrong."""
    where = f"messages[{i}]"
    if not isinstance(d, Mapping):
        raise bad(f"{where} must be an object, got {type(d).__name__}", "messages")
    role = d.get("role")
    if role == "developer":  # OpenAI's newer name for system instructions
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"{where}.role {role!r} is not one of 'system', 'user', 'assistant', 'tool'", f"{where}.role")
    content, images = _content(d.get("content"), where, codec)
    if images and role not in ("user", "tool"):
        raise bad(f"{where}: images are accepted in user and tool messages only (role {role!r})", f"{where}.content")
    if role != "assistant":
        if d.get("tool_calls"):
            raise bad(f"{where}: only assistant messages may carry tool_calls (role {role!r})", f"{where}.tool_calls")
        if role == "tool" and d.get("tool_call_id") is not None and not isinstance(d.get("tool_call_id"), str):
            raise bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        return Message(role=role, content=codec.defuse(content), tool_call_id=d.get("tool_call_id") if role == "tool" else None,
                       images=images)
    raw_calls = d.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = tuple(_parse_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls))
    reasoning = d.get("reasoning_content", d.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise bad(f"{where}.reasoning_content must be a string or null", f"{where}.reasoning_content")
    return Message(role="assistant", content=content, tool_calls=calls, reasoning=reasoning or None)


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def _parse_tools(raw: Any) -> tuple[Mapping[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad("tools must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    for j, t in enumerate(raw):
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            raise bad(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}", f"tools[{j}]")
        name = t["function"].get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"tools[{j}].function.name must be a non-empty string", f"tools[{j}].function.name")
        if t["function"].get("strict") is not None and not isinstance(t["function"]["strict"], bool):
            raise bad(f"tools[{j}].function.strict must be a boolean", f"tools[{j}].function.strict")
    names = _tool_names(raw)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad(f"tools: duplicate function names {dup}", "tools")
    return tuple(raw) or None


def _parse_tool_choice(raw: Any, tools: tuple[Mapping[str, Any], ...] | None) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad(f"tool_choice {raw!r} is not 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
        if raw != "none" and not tools:
            raise bad(f"tool_choice {raw!r} needs a non-empty 'tools' list", "tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    if isinstance(raw, Mapping) and raw.get("type") == "function" and isinstance(raw.get("function"), Mapping):
        name = raw["function"].get("name")
        if not tools:
            raise bad("a named tool_choice needs a non-empty 'tools' list", "tool_choice")
        if name not in _tool_names(tools):
            raise bad(f"tool_choice names function {name!r}, which is not in tools {_tool_names(tools)}", "tool_choice")
        return ToolChoice("function", name)
    raise bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(items) > 4:
        raise bad(f"stop has {len(items)} strings; at most 4 are allowed", "stop")
    return tuple(items)


def parse_chat_request(body: Any, settings: ServeSettings, model_names: Sequence[str], codec: ServeCodec) -> ChatRequest:
    """Validate a decoded JSON body; every problem is an ApiError naming the field."""
    if not isinstance(body, Mapping):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    body = merge_extra_body(body)
    model = check_model(body.get("model"), model_names)
    raw_messages = body.get("messages")
    if raw_messages is None:
        raise bad("messages is required: a non-empty list of chat messages", "messages", "missing_required_parameter")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad("messages must be a non-empty list of chat messages", "messages")
    check_limits(len(raw_messages), body.get("max_completion_tokens", body.get("max_tokens")), settings,
                 "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")
    messages = tuple(parse_message(m, i, codec) for i, m in enumerate(raw_messages))
    if messages[-1].role == "assistant":
        raise bad("the last message is from the assistant; this server does not continue a partial assistant "
                   "message (send the conversation up to a user or tool message)", f"messages[{len(messages) - 1}].role")
    tools = _parse_tools(body.get("tools"))
    tool_choice = _parse_tool_choice(body.get("tool_choice"), tools)
    tier, budget, default_budget = budget_fields(body, settings)

    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise bad("max_tokens and max_completion_tokens disagree; send one", "max_tokens")
    mparam = "max_completion_tokens" if mct is not None else "max_tokens"
    max_tokens = parse_max_tokens(mct if mct is not None else mt, mparam)

    temperature, top_p = sampling_numbers(body, max_temperature=2.0)
    seed = parse_seed(body.get("seed"))
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not is_int(n) or not 1 <= n <= settings.max_n:
        raise bad(f"n must be an integer in [1, {settings.max_n}], got {n!r}", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad(f"stream must be a boolean, got {stream!r}", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = bool(opts.get("include_usage", False))
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) and logprobs is not None:
        raise bad(f"logprobs must be a boolean, got {logprobs!r}", "logprobs")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is None:
        top_logprobs = 0
    if not is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {brief(top_logprobs)}", "top_logprobs")
    if top_logprobs and not logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if logprobs and stream:
        raise bad("logprobs with stream=true is not supported by this server; use a non-streamed request", "logprobs")

    # Sampling controls the engine does not implement: refuse non-default values rather than ignore them.
    for key, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
        v = body.get(key)
        if v is not None and v != neutral:
            raise bad(f"{key} is not supported by this server (only {neutral})", key)
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported by this server", "logit_bias")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, Mapping) and rf.get("type") == "text"):
        raise bad("response_format other than {'type': 'text'} (JSON mode, structured outputs) is not supported by this server", "response_format")
    user = body.get("user")
    metadata = body.get("metadata")
    return ChatRequest(
        model=model, messages=messages, raw_messages=tuple(raw_messages), tools=tools, tool_choice=tool_choice,
        tier=tier, thinking_budget=budget, max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
        seed=seed, stop=_parse_stop(body.get("stop")), n=int(n), stream=bool(stream), include_usage=include_usage,
        logprobs=bool(logprobs), top_logprobs=int(top_logprobs), user=user if isinstance(user, str) else None,
        metadata=metadata if isinstance(metadata, Mapping) else None, default_budget=default_budget,
    )



def usage_json(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, Any]:
    completion = sum(len(c.completion.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)},
    }


def _token_json(tokenizer: TokenizerLike, t: int, lp: float) -> dict[str, Any]:
    s = tokenizer.decode([t], skip_special_tokens=False)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def logprobs_json(c: Choice, tokenizer: TokenizerLike, top_logprobs: int = 0) -> dict[str, Any]:
    """OpenAI's `logprobs.content`: per token its logprob and, when asked, the `top_logprobs` most likely
    alternatives the engine saw at that position (vLLM's, most likely first)."""
    content = []
    tops = c.completion.top or ((),) * len(c.completion.token_ids)
    for t, lp, top in zip(c.completion.token_ids, c.completion.logprobs, tops):
        entry = _token_json(tokenizer, t, 0.0 if lp is None else lp)
        entry["top_logprobs"] = [_token_json(tokenizer, a, alp) for a, alp in top[:top_logprobs]] if top_logprobs else []
        if lp is None:
            entry["forced"] = True  # appended by the server (tool_choice), not sampled
        content.append(entry)
    return {"content": content}


def completion_json(rid: str, created: int, model: str, prompt_tokens: int, choices: Sequence[Choice],
                    tokenizer: TokenizerLike | None = None, with_logprobs: bool = False, top_logprobs: int = 0) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": message_json(c.message),
                "finish_reason": c.finish_reason,
                "logprobs": logprobs_json(c, tokenizer, top_logprobs) if (with_logprobs and tokenizer is not None) else None,
                "parse_errors": list(c.parse_errors),
            }
            for c in choices
        ],
        "usage": usage_json(prompt_tokens, choices),
    }


def _field_pieces(text: str, ends: Sequence[int], value: str, start: int) -> tuple[list[str], int]:
    """Split `value` (found in `text` at or after `start`) at token boundaries; falls back to one piece."""
    if not value:
        return [], start
    a = text.find(value, start)
    if a < 0:
        return [value], start
    b = a + len(value)
    cuts = [a] + [e for e in ends if a < e < b] + [b]
    return [text[x:y] for x, y in zip(cuts, cuts[1:]) if y > x], b


def stream_chunks(rid: str, created: int, model: str, prompt_tokens: int, choices: Sequence[Choice],
                  include_usage: bool) -> Iterator[dict[str, Any]]:
    """The OpenAI `chat.completion.chunk` objects of a finished reply, in order.

    Per choice: a role chunk, token-aligned `reasoning_content` deltas, `content` deltas, one chunk
    with all tool calls, and a final chunk carrying finish_reason. Joining the deltas gives exactly
    the non-streamed message (tested).
    """
    def chunk(delta: dict[str, Any], index: int, finish: str | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    for c in choices:
        yield chunk({"role": "assistant", "content": ""}, c.index)
        pos = 0
        pieces, pos = _field_pieces(c.text, c.token_ends, c.message.reasoning or "", pos)
        for p in pieces:
            yield chunk({"reasoning_content": p}, c.index)
        pieces, pos = _field_pieces(c.text, c.token_ends, c.message.content, pos)
        for p in pieces:
            yield chunk({"content": p}, c.index)
        if c.message.tool_calls:
            yield chunk({"tool_calls": [{"index": j, **tc.to_openai()} for j, tc in enumerate(c.message.tool_calls)]}, c.index)
        yield chunk({}, c.index, c.finish_reason)
    if include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": usage_json(prompt_tokens, choices)}



def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(prep: Prepared, events: AsyncIterator[TextDelta | Finished]) -> AsyncIterator[bytes]:
    """The streamed reply as SSE bytes, sent as the service produces text.

    Per choice: a role chunk at once, `reasoning_content` / `content` deltas as they become final, one
    chunk with all tool calls and one with finish_reason when the choice ends; a usage chunk if
    `stream_options.include_usage`; then `data: [DONE]`. A failure after the first byte is sent as a
    last `{"error": ...}` event (the status line is gone by then).
    """
    req = prep.req
    head = {"id": prep.id, "object": "chat.completion.chunk", "created": prep.created, "model": req.model}

    def chunk(delta: dict[str, Any], index: int, finish: str | None = None) -> bytes:
        return _sse({**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    for i in range(req.n):
        yield chunk({"role": "assistant", "content": ""}, i)
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield chunk({"reasoning_content" if ev.field == "reasoning" else "content": ev.text}, ev.choice)
                continue
            for c in ev.choices:
                if c.message.tool_calls:
                    yield chunk({"tool_calls": [{"index": j, **tc.to_openai()} for j, tc in enumerate(c.message.tool_calls)]}, c.index)
                yield chunk({}, c.index, c.finish_reason)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage_json(prep.n_prompt, ev.choices)})
    except ApiError as e:
        yield _sse(e.body())
    yield b"data: [DONE]\n\n"
