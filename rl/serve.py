"""`jointrl serve`: an OpenAI-compatible chat endpoint over the project's in-process vLLM rollout engine.

What it does
- `/v1/models`, `/v1/chat/completions` (plain and streamed), `/health`, on FastAPI + uvicorn. The
  engine is `rl.rollout.engine.RolloutEngine` in this process; concurrent HTTP requests are
  grouped into engine submits and batch inside vLLM (continuous batching).
- Prompts are token-in / token-out with the project chat format (`model/chat.py`): messages are
  rendered with `chat.render(..., add_generation_prompt=True)` and tokenised; generation stops at
  `<|im_end|>`; the completion is decoded with special tokens kept and parsed by
  `chat.parse_assistant` into `reasoning_content`, `content` and `tool_calls`.
- Thinking budgets: `thinking_budget` (`low`/`high`/`max`, or a token count; `reasoning_effort` is
  an alias) maps to token budgets from `rl.config.RolloutSection.thinking_budgets`; vLLM forces
  `</think>` when the thinking segment reaches the budget.
- `tool_choice`: `auto` (parse what the model writes), `none` (generation stops at a `<tool_call>`
  token and no call is returned), `required` / a named function (after thinking ends, the server
  appends the tool-call opening - `<tool_call>` and, for a named function, its name - as forced
  prompt tokens and lets the model write the rest). Forced tokens have loss mask 0 in the records.
- Token reuse across turns: when a request's rendered history extends an earlier request's prompt
  + completion exactly (the client sent the assistant message back as it was returned), the server
  reuses the token ids the model actually sampled instead of re-tokenising the text. The turns of
  such a conversation then form one append-only token sequence, as in `rl/rollout/agent_loop.py`.
- Recording (`--record-dir`): one JSON line per request with prompt ids, completion ids, sampled
  logprobs, loss mask, messages and a `continues` link to the record whose tokens it extends.
  `read_records` / `recorded_sequence` turn a chain of records back into one RL token sequence.
- Invalid requests get OpenAI-style 4xx JSON errors `{"error": {message, type, param, code}}`.

What it does not do
- Incremental streaming: `RolloutEngine` returns finished requests only, so a streamed reply is
  generated first and then sent as OpenAI SSE chunks (token-aligned `reasoning_content` / `content`
  deltas, tool calls in one chunk at the end, `[DONE]`). Time to first byte = generation time.
- Stop strings are applied to the finished text (vLLM's engine here runs without detokenisation):
  the reply is cut at the first stop string, the generation itself is not cut short.
- Structured outputs / JSON mode, logit_bias, penalties, top_logprobs > 0, images: refused with a
  400 naming the field. Authentication: none (it binds 127.0.0.1 by default).
- Aborting a request whose client went away: the engine has no abort call; the request finishes.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Literal, Mapping, Protocol, Sequence

from starlette.requests import Request  # module level: FastAPI resolves the handlers' (string) annotations here

from jointrl.records import Message, ToolCall
from model import chat
from rl.config import RolloutSection
from rl.log import get_logger

log = get_logger("serve")

Tier = Literal["low", "high", "max"]
TIERS: tuple[str, ...] = ("low", "high", "max")
RECORD_VERSION = 1


# ============================================================================ errors
class ApiError(Exception):
    """An error reply in the OpenAI format; raised by request validation and turned into JSON by the app."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ServeError(RuntimeError):
    """The server cannot start (bad model argument, missing plugin, ...), with a message naming why."""


# ============================================================================ settings
def _default_budgets() -> dict[str, int]:
    return dict(RolloutSection().thinking_budgets)  # one source of truth: the rollout config defaults


@dataclass(frozen=True)
class ServeSettings:
    """How the server builds its engine and answers requests."""

    max_model_len: int = 2048
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: float32, bfloat16 for models with delta layers on CPU (vLLM's CPU kernel needs it)
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    seed: int = 0  # engine seed, and the random-init seed of a shipped config
    thinking_budgets: Mapping[str, int] = field(default_factory=_default_budgets)  # tier -> tokens; < 0 = no cap
    default_tier: Tier = "high"  # when a request names no thinking budget
    max_n: int = 8  # largest `n` accepted
    served_name: str | None = None  # default: the shipped config name or the checkpoint directory's name
    token_cache_entries: int = 4096  # completions remembered for token reuse across turns
    cache_dir: str | None = None  # where shipped configs are materialised (default: $JOINTRL_CACHE/serve)

    def __post_init__(self) -> None:
        if self.max_model_len <= 0:
            raise ServeError(f"ServeSettings.max_model_len must be > 0, got {self.max_model_len}")
        missing = [t for t in TIERS if t not in self.thinking_budgets]
        if missing:
            raise ServeError(f"ServeSettings.thinking_budgets lacks tiers {missing} (needs low, high, max)")
        if self.default_tier not in TIERS:
            raise ServeError(f"ServeSettings.default_tier {self.default_tier!r} is not one of {TIERS}")
        if self.max_n < 1:
            raise ServeError(f"ServeSettings.max_n must be >= 1, got {self.max_n}")


# ============================================================================ request parsing
@dataclass(frozen=True)
class ToolChoice:
    """mode `function` names one tool; the others carry no name."""

    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    """A validated /v1/chat/completions request."""

    model: str
    messages: tuple[Message, ...]
    raw_messages: tuple[Mapping[str, Any], ...]  # as received, for the record
    tools: tuple[Mapping[str, Any], ...] | None
    tool_choice: ToolChoice
    tier: str | None  # the named tier, None when an explicit token count was given
    thinking_budget: int | None  # tokens; None = no cap
    max_tokens: int | None  # None: up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str | None = None
    metadata: Mapping[str, Any] | None = None


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text_content(content: Any, where: str) -> str:
    """OpenAI content (a string, null or a list of text parts) -> text; images are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise _bad(f"{where}.content[{j}] must be an object with a 'type'", f"{where}.content")
            if part["type"] != "text":
                raise _bad(f"{where}.content[{j}]: content parts of type {part['type']!r} are not supported "
                           "by this server (text only)", f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}].text must be a string", f"{where}.content")
            out.append(part["text"])
        return "".join(out)
    raise _bad(f"{where}.content must be a string, null or a list of text parts, got {type(content).__name__}",
               f"{where}.content")


def _parse_tool_call(d: Any, where: str) -> ToolCall:
    if not isinstance(d, Mapping):
        raise _bad(f"{where} must be an object", where)
    fn = d.get("function")
    if not isinstance(fn, Mapping):
        raise _bad(f"{where}.function must be an object with 'name' and 'arguments'", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if args is None:
        args = "{}"
    if isinstance(args, Mapping):
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise _bad(f"{where}.function.arguments must be a JSON string", f"{where}.function.arguments")
    try:
        parsed = json.loads(args)
    except ValueError as e:
        raise _bad(f"{where}.function.arguments is not valid JSON ({e}): {args[:200]!r}", f"{where}.function.arguments") from None
    if not isinstance(parsed, dict):
        raise _bad(f"{where}.function.arguments must be a JSON object, got {args[:200]!r}", f"{where}.function.arguments")
    call_id = d.get("id", "")
    return ToolCall(id=str(call_id or ""), name=name, arguments=args)


def parse_message(d: Any, i: int) -> Message:
    """One OpenAI message dict -> `Message`, or ApiError naming what is wrong."""
    where = f"messages[{i}]"
    if not isinstance(d, Mapping):
        raise _bad(f"{where} must be an object, got {type(d).__name__}", "messages")
    role = d.get("role")
    if role == "developer":  # OpenAI's newer name for system instructions
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise _bad(f"{where}.role {role!r} is not one of 'system', 'user', 'assistant', 'tool'", f"{where}.role")
    content = _text_content(d.get("content"), where)
    if role != "assistant":
        if d.get("tool_calls"):
            raise _bad(f"{where}: only assistant messages may carry tool_calls (role {role!r})", f"{where}.tool_calls")
        if role == "tool" and d.get("tool_call_id") is not None and not isinstance(d.get("tool_call_id"), str):
            raise _bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        return Message(role=role, content=chat.defuse(content), tool_call_id=d.get("tool_call_id") if role == "tool" else None)
    raw_calls = d.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = tuple(_parse_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls))
    reasoning = d.get("reasoning_content", d.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise _bad(f"{where}.reasoning_content must be a string or null", f"{where}.reasoning_content")
    return Message(role="assistant", content=content, tool_calls=calls, reasoning=reasoning or None)


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def _parse_tools(raw: Any) -> tuple[Mapping[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    for j, t in enumerate(raw):
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            raise _bad(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}", f"tools[{j}]")
        name = t["function"].get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{j}].function.name must be a non-empty string", f"tools[{j}].function.name")
    names = _tool_names(raw)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _bad(f"tools: duplicate function names {dup}", "tools")
    return tuple(raw) or None


def _parse_tool_choice(raw: Any, tools: tuple[Mapping[str, Any], ...] | None) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise _bad(f"tool_choice {raw!r} is not 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
        if raw != "none" and not tools:
            raise _bad(f"tool_choice {raw!r} needs a non-empty 'tools' list", "tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    if isinstance(raw, Mapping) and raw.get("type") == "function" and isinstance(raw.get("function"), Mapping):
        name = raw["function"].get("name")
        if not tools:
            raise _bad("a named tool_choice needs a non-empty 'tools' list", "tool_choice")
        if name not in _tool_names(tools):
            raise _bad(f"tool_choice names function {name!r}, which is not in tools {_tool_names(tools)}", "tool_choice")
        return ToolChoice("function", name)
    raise _bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _parse_budget(body: Mapping[str, Any], settings: ServeSettings) -> tuple[str | None, int | None]:
    tb, effort = body.get("thinking_budget"), body.get("reasoning_effort")
    if tb is not None and effort is not None and tb != effort:
        raise _bad(f"thinking_budget {tb!r} and its alias reasoning_effort {effort!r} disagree; send one", "thinking_budget")
    value = tb if tb is not None else effort
    param = "thinking_budget" if tb is not None else "reasoning_effort"
    if value is None:
        value = settings.default_tier
    if _is_int(value):
        if value < 0:
            raise _bad(f"{param} as a token count must be >= 0, got {value}", param)
        return None, int(value)
    if isinstance(value, str) and value in TIERS:
        n = int(settings.thinking_budgets[value])
        return value, (None if n < 0 else n)
    raise _bad(f"{param} {value!r} is not one of {list(TIERS)} (or a token count >= 0)", param)


def _parse_stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise _bad("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(items) > 4:
        raise _bad(f"stop has {len(items)} strings; at most 4 are allowed", "stop")
    return tuple(items)


def parse_chat_request(body: Any, settings: ServeSettings, model_names: Sequence[str]) -> ChatRequest:
    """Validate a decoded JSON body; every problem is an ApiError naming the field."""
    if not isinstance(body, Mapping):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    model = body.get("model")
    if model is None:
        model = model_names[0]
    if not isinstance(model, str):
        raise _bad("model must be a string", "model")
    if model not in model_names:
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {model_names[0]!r} (see /v1/models)",
                       param="model", code="model_not_found")
    raw_messages = body.get("messages")
    if raw_messages is None:
        raise _bad("messages is required: a non-empty list of chat messages", "messages", "missing_required_parameter")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _bad("messages must be a non-empty list of chat messages", "messages")
    messages = tuple(parse_message(m, i) for i, m in enumerate(raw_messages))
    if messages[-1].role == "assistant":
        raise _bad("the last message is from the assistant; this server does not continue a partial assistant "
                   "message (send the conversation up to a user or tool message)", f"messages[{len(messages) - 1}].role")
    tools = _parse_tools(body.get("tools"))
    tool_choice = _parse_tool_choice(body.get("tool_choice"), tools)
    tier, budget = _parse_budget(body, settings)

    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise _bad(f"max_tokens {mt!r} and max_completion_tokens {mct!r} disagree; send one", "max_tokens")
    max_tokens = mct if mct is not None else mt
    mparam = "max_completion_tokens" if mct is not None else "max_tokens"
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens <= 0):
        raise _bad(f"{mparam} must be an integer > 0, got {max_tokens!r}", mparam)

    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise _bad(f"temperature must be a number in [0, 2], got {temperature!r}", "temperature")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise _bad(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad(f"seed must be an integer, got {seed!r}", "seed")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= settings.max_n:
        raise _bad(f"n must be an integer in [1, {settings.max_n}], got {n!r}", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _bad(f"stream must be a boolean, got {stream!r}", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise _bad("stream_options must be an object", "stream_options")
    include_usage = bool(opts.get("include_usage", False))
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) and logprobs is not None:
        raise _bad(f"logprobs must be a boolean, got {logprobs!r}", "logprobs")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs not in (None, 0):
        raise _bad("top_logprobs > 0 is not supported by this server (the engine returns the sampled token's logprob only)", "top_logprobs")
    if logprobs and stream:
        raise _bad("logprobs with stream=true is not supported by this server; use a non-streamed request", "logprobs")

    # Sampling controls the engine does not implement: refuse non-default values rather than ignore them.
    for key, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
        v = body.get(key)
        if v is not None and v != neutral:
            raise _bad(f"{key} is not supported by this server (only {neutral})", key)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported by this server", "logit_bias")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, Mapping) and rf.get("type") == "text"):
        raise _bad("response_format other than {'type': 'text'} (JSON mode, structured outputs) is not supported by this server", "response_format")
    user = body.get("user")
    metadata = body.get("metadata")
    return ChatRequest(
        model=model, messages=messages, raw_messages=tuple(raw_messages), tools=tools, tool_choice=tool_choice,
        tier=tier, thinking_budget=budget, max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
        seed=seed, stop=_parse_stop(body.get("stop")), n=int(n), stream=bool(stream), include_usage=include_usage,
        logprobs=bool(logprobs), user=user if isinstance(user, str) else None,
        metadata=metadata if isinstance(metadata, Mapping) else None,
    )


# ============================================================================ token reuse across turns
@dataclass(frozen=True)
class PromptTokens:
    """A request's prompt ids. The first `reused` ids are an earlier completion's exact ids (from `continues`)."""

    token_ids: tuple[int, ...]
    reused: int = 0
    continues: tuple[str, int] | None = None  # (record id, choice index)


class TokenHistory:
    """Remembers `prompt text + generated text -> the ids the engine saw and sampled`, for reuse next turn.

    Only completions that ended with `<|im_end|>` are stored, keyed by their full text (which ends
    with `<|im_end|>`). A later prompt text that extends a stored text exactly at such a boundary
    reuses the stored ids and tokenises only the rest - the rest starts with "\\n" right after a
    special token, so tokenising it alone gives the ids tokenising the whole would (chat format
    guarantee, docs/chat_format.md). A bounded LRU; thread-safe.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[tuple[int, ...], tuple[str, int]]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def remember(self, text: str, token_ids: Sequence[int], source: tuple[str, int]) -> None:
        if self.capacity <= 0 or not text.endswith(chat.IM_END_TOKEN):
            return
        with self._lock:
            k = self._key(text)
            self._entries[k] = (tuple(token_ids), source)
            self._entries.move_to_end(k)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def longest_prefix(self, text: str) -> tuple[int, tuple[int, ...], tuple[str, int]] | None:
        """(chars covered, ids, source) of the longest stored text that `text` extends at a turn boundary."""
        ends = []
        pos = text.find(chat.IM_END_TOKEN)
        while pos >= 0:
            ends.append(pos + len(chat.IM_END_TOKEN))
            pos = text.find(chat.IM_END_TOKEN, pos + 1)
        with self._lock:
            for end in reversed(ends):
                hit = self._entries.get(self._key(text[:end]))
                if hit is not None:
                    self._entries.move_to_end(self._key(text[:end]))
                    return end, hit[0], hit[1]
        return None

    def __len__(self) -> int:
        return len(self._entries)


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def encode_prompt(text: str, tokenizer: TokenizerLike, history: TokenHistory | None) -> PromptTokens:
    hit = history.longest_prefix(text) if history is not None else None
    if hit is None:
        return PromptTokens(tuple(tokenizer.encode(text, add_special_tokens=False)))
    chars, ids, source = hit
    rest = tokenizer.encode(text[chars:], add_special_tokens=False) if chars < len(text) else []
    return PromptTokens(tuple(ids) + tuple(rest), reused=len(ids), continues=source)


# ============================================================================ completions -> replies
@dataclass(frozen=True)
class Completion:
    """Everything appended after the prompt for one choice: generated ids (mask 1) and forced ids (mask 0)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]  # None on forced tokens
    loss_mask: tuple[int, ...]
    engine_finish: str  # the last engine call's finish reason: stop / length / abort
    policy_version: int = 0

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.loss_mask):
            raise ValueError(f"Completion: {len(self.token_ids)} ids, {len(self.logprobs)} logprobs, {len(self.loss_mask)} mask entries")


@dataclass(frozen=True)
class Choice:
    """One finished choice, ready to be sent (plain or streamed) and recorded."""

    index: int
    completion: Completion
    text: str  # decoded completion with special tokens, cut at a stop string (what was parsed)
    message: Message
    finish_reason: Literal["stop", "length", "tool_calls"]
    parse_errors: tuple[str, ...]
    reasoning_tokens: int  # generated tokens before </think> (all of them if thinking never closed)
    token_ends: tuple[int, ...]  # token_ends[i] = len(text of tokens[: i + 1]) within `text` (stream deltas)


def token_text_ends(tokenizer: TokenizerLike, ids: Sequence[int]) -> tuple[int, ...]:
    """Character offset in decode(ids) after each token.

    Fast path: decoding tokens one by one, when their concatenation is the whole text (ASCII and
    whole-character tokens). Otherwise tokens that split a UTF-8 character are grouped with the
    next token (their offset repeats) by decoding growing prefixes.
    """
    full = tokenizer.decode(list(ids), skip_special_tokens=False)
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    if "".join(pieces) == full:
        out, acc = [], 0
        for p in pieces:
            acc += len(p)
            out.append(acc)
        return tuple(out)
    out, last = [], 0
    for i in range(len(ids)):
        prefix = tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=False)
        if not prefix.endswith("\ufffd") and full.startswith(prefix):
            last = len(prefix)
        out.append(last)
    out[-1] = len(full) if out else 0
    return tuple(out)


def _cut_at_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in `text`, or None."""
    hits = [(p, p + len(s)) for p, s in ((text.find(s), s) for s in stops) if p >= 0]
    return min(hits) if hits else None


def finish_choice(index: int, comp: Completion, tokenizer: TokenizerLike, req: ChatRequest, turn: int) -> Choice:
    """Decode, apply stop strings and tool_choice, parse into an assistant message."""
    ids = comp.token_ids
    ends = token_text_ends(tokenizer, ids)
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    finish: str = "length" if comp.engine_finish == "length" else "stop"
    if req.tool_choice.mode == "none" and ids and ids[-1] == chat.TOOL_CALL_START_ID and comp.engine_finish == "stop":
        # Generation was stopped at the opening of a tool call: the reply ends before it.
        text = text[: ends[-2]] if len(ends) > 1 else ""
        if text.endswith("\n"):  # the separator the format puts between content and a tool call
            text = text[:-1]
        finish = "stop"
    cut = _cut_at_stop(text, req.stop)
    if cut is not None:
        # Like a stop string in vLLM: the reply ends before it; the ids end with the token completing it
        # (later tokens were generated only because the engine cannot stop on strings: dropped).
        keep = next(i + 1 for i, e in enumerate(ends) if e >= cut[1])
        comp = Completion(ids[:keep], comp.logprobs[:keep], comp.loss_mask[:keep], "stop", comp.policy_version)
        ids, ends = comp.token_ids, ends[:keep]
        text, finish = text[: cut[0]], "stop"
    ends = tuple(min(e, len(text)) for e in ends)
    parsed = chat.parse_assistant(text, turn)
    msg = parsed.message
    if req.tool_choice.mode == "none" and msg.tool_calls:
        msg = replace(msg, tool_calls=())  # cannot happen after the stop above; kept as a guarantee
    if msg.tool_calls and finish == "stop":
        finish = "tool_calls"
    if chat.THINK_END_ID in ids:
        reasoning_tokens = ids.index(chat.THINK_END_ID)
    else:
        reasoning_tokens = len(ids)
    return Choice(index=index, completion=comp, text=text, message=msg, finish_reason=finish,  # type: ignore[arg-type]
                  parse_errors=parsed.errors, reasoning_tokens=reasoning_tokens, token_ends=ends)


def message_json(m: Message) -> dict[str, Any]:
    """The reply message in OpenAI form (content null when there are only tool calls)."""
    d: dict[str, Any] = {"role": "assistant", "content": m.content if (m.content or not m.tool_calls) else None}
    d["reasoning_content"] = m.reasoning
    if m.tool_calls:
        d["tool_calls"] = [tc.to_openai() for tc in m.tool_calls]
    return d


def usage_json(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, Any]:
    completion = sum(len(c.completion.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)},
    }


def _logprobs_json(c: Choice, tokenizer: TokenizerLike) -> dict[str, Any]:
    content = []
    for t, lp in zip(c.completion.token_ids, c.completion.logprobs):
        s = tokenizer.decode([t], skip_special_tokens=False)
        entry: dict[str, Any] = {"token": s, "logprob": 0.0 if lp is None else lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
        if lp is None:
            entry["forced"] = True  # appended by the server (tool_choice), not sampled
        content.append(entry)
    return {"content": content}


def completion_json(rid: str, created: int, model: str, prompt_tokens: int, choices: Sequence[Choice],
                    tokenizer: TokenizerLike | None = None, with_logprobs: bool = False) -> dict[str, Any]:
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
                "logprobs": _logprobs_json(c, tokenizer) if (with_logprobs and tokenizer is not None) else None,
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


# ============================================================================ records
@dataclass(frozen=True)
class RecordedChoice:
    index: int
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]  # None where the server forced the token
    loss_mask: tuple[int, ...]  # 1 = sampled by the policy, 0 = forced by the server
    finish_reason: str
    text: str
    message: Mapping[str, Any]
    parse_errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServeRecord:
    """One request/response, token level. See docs/serve.md for the JSONL layout."""

    id: str
    created: float
    model: str
    policy_version: int
    request: Mapping[str, Any]  # messages, tools, tool_choice, thinking tier/budget, sampling params, user, metadata
    prompt_token_ids: tuple[int, ...]
    prompt_reused_tokens: int  # leading prompt ids copied from the `continues` record's prompt + completion
    continues: tuple[str, int] | None  # (record id, choice index) this prompt extends, or None
    choices: tuple[RecordedChoice, ...]
    record_version: int = RECORD_VERSION

    def to_json(self) -> str:
        d = {
            "record_version": self.record_version, "id": self.id, "created": self.created, "model": self.model,
            "policy_version": self.policy_version, "request": self.request,
            "prompt_token_ids": list(self.prompt_token_ids), "prompt_reused_tokens": self.prompt_reused_tokens,
            "continues": None if self.continues is None else {"id": self.continues[0], "choice": self.continues[1]},
            "choices": [
                {"index": c.index, "completion_token_ids": list(c.completion_token_ids), "logprobs": list(c.logprobs),
                 "loss_mask": list(c.loss_mask), "finish_reason": c.finish_reason, "text": c.text,
                 "message": c.message, "parse_errors": list(c.parse_errors)}
                for c in self.choices
            ],
        }
        return json.dumps(d, ensure_ascii=False)

    @staticmethod
    def from_json(line: str) -> "ServeRecord":
        d = json.loads(line)
        if d.get("record_version") != RECORD_VERSION:
            raise ValueError(f"record {d.get('id')!r}: record_version {d.get('record_version')!r}, this reader knows {RECORD_VERSION}")
        cont = d["continues"]
        return ServeRecord(
            id=d["id"], created=d["created"], model=d["model"], policy_version=d["policy_version"], request=d["request"],
            prompt_token_ids=tuple(d["prompt_token_ids"]), prompt_reused_tokens=d["prompt_reused_tokens"],
            continues=None if cont is None else (cont["id"], int(cont["choice"])),
            choices=tuple(
                RecordedChoice(index=c["index"], completion_token_ids=tuple(c["completion_token_ids"]), logprobs=tuple(c["logprobs"]),
                               loss_mask=tuple(c["loss_mask"]), finish_reason=c["finish_reason"], text=c["text"],
                               message=c["message"], parse_errors=tuple(c["parse_errors"]))
                for c in d["choices"]
            ),
            record_version=d["record_version"],
        )


class Recorder:
    """Appends ServeRecords as JSON lines to `<dir>/serve-<time>-<pid>.jsonl` (one file per server run)."""

    def __init__(self, record_dir: str | os.PathLike[str]) -> None:
        d = Path(record_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()

    def write(self, record: ServeRecord) -> None:
        line = record.to_json() + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


def read_records(path: str | os.PathLike[str]) -> list[ServeRecord]:
    """All records of one JSONL file (or of every *.jsonl file in a directory), in file order."""
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    out.append(ServeRecord.from_json(line))
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{f}:{n}: not a serve record ({e})") from None
    return out


@dataclass(frozen=True)
class RecordedSequence:
    """One append-only token sequence rebuilt from a chain of records (an RL sample)."""

    record_ids: tuple[str, ...]  # the chain, first turn first
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 exactly on tokens the policy sampled
    logprobs: tuple[float, ...]  # sampled logprob where loss_mask == 1, else 0.0


def recorded_sequence(records: Mapping[str, ServeRecord] | Sequence[ServeRecord], record_id: str, choice: int = 0) -> RecordedSequence:
    """Prompt + completion of `record_id`'s choice, with the loss mask and logprobs of every earlier turn it extends."""
    by_id = records if isinstance(records, Mapping) else {r.id: r for r in records}
    chain: list[tuple[ServeRecord, int]] = []
    rid, ch = record_id, choice
    while True:
        rec = by_id.get(rid)
        if rec is None:
            raise KeyError(f"record {rid!r} not found (chain: {[r.id for r, _ in chain]})")
        if not 0 <= ch < len(rec.choices):
            raise KeyError(f"record {rid!r} has no choice {ch}")
        chain.append((rec, ch))
        if rec.continues is None:
            break
        rid, ch = rec.continues
    chain.reverse()
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for rec, ch in chain:
        if tuple(ids) != rec.prompt_token_ids[: rec.prompt_reused_tokens] or len(ids) != rec.prompt_reused_tokens:
            raise ValueError(f"record {rec.id!r}: its first {rec.prompt_reused_tokens} prompt ids are not the tokens of the record it continues")
        rest = rec.prompt_token_ids[len(ids):]
        ids += rest
        mask += [0] * len(rest)
        lps += [0.0] * len(rest)
        c = rec.choices[ch]
        ids += c.completion_token_ids
        mask += list(c.loss_mask)
        lps += [0.0 if lp is None else float(lp) for lp in c.logprobs]
    return RecordedSequence(record_ids=tuple(r.id for r, _ in chain), token_ids=tuple(ids), loss_mask=tuple(mask), logprobs=tuple(lps))


# ============================================================================ the service
class EngineLike(Protocol):
    """What the service needs from `RolloutEngine`."""

    policy_version: int

    def submit(self, requests: Sequence[Any]) -> list[Any]: ...  # -> concurrent Futures of GenerateResult

    def num_pending(self) -> int: ...


def _forced_prefix(tc: ToolChoice) -> str:
    """Text appended after `</think>` to make the model call a tool (the chat format's call layout)."""
    head = f"\n\n{chat.TOOL_CALL_START_TOKEN}\n" + '{"name": '
    if tc.mode == "function":
        return head + json.dumps(tc.name, ensure_ascii=False) + ', "arguments": '
    return head + '"'


class ChatService:
    """Turns validated requests into engine calls and replies; owns token reuse and recording."""

    def __init__(self, engine: EngineLike, tokenizer: Any, settings: ServeSettings, model_names: Sequence[str],
                 max_model_len: int, recorder: Recorder | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_names = tuple(model_names)
        self.max_model_len = max_model_len
        self.recorder = recorder
        self.history = TokenHistory(settings.token_cache_entries)
        self.created = int(time.time())
        self.requests = 0
        self.peak_engine_pending = 0  # most engine requests pending right after a submit
        self.inflight = 0  # HTTP requests generating now
        self.peak_inflight = 0  # most HTTP requests generating at once: > 1 means they shared engine steps (batched)
        self._stats_lock = threading.Lock()
        self._queue: list[tuple[list[Any], asyncio.Future]] = []  # event-loop only
        self._flusher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._split_next = 0  # after a failed grouped submit: submit this many queue entries alone

    # -- engine calls
    async def _generate(self, reqs: Sequence[Any]) -> list[Any]:
        """Queue requests for the next engine submit; await their results.

        `RolloutEngine.submit` takes the engine's lock, which its stepper holds for a whole step, so
        each submit waits up to one step. Requests that arrive while a submit is waiting are
        collected and sent together in the next one (one lock acquisition per step, not per HTTP
        request): at 64 concurrent requests this is what lets them join the running batch quickly.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._queue.append((list(reqs), fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        while self._queue:
            if self._split_next > 0:
                batch, self._queue = self._queue[:1], self._queue[1:]
                self._split_next -= 1
            else:
                batch, self._queue = self._queue, []
            flat = [r for reqs, _ in batch for r in reqs]
            try:
                futures = await asyncio.to_thread(self.engine.submit, flat)
            except Exception as e:  # noqa: BLE001
                if len(batch) == 1:
                    batch[0][1].set_exception(e)
                    continue
                # One bad request must not fail the others it was grouped with: resubmit them one by one.
                self._queue = [([*reqs], f) for reqs, f in batch] + self._queue
                self._split_next = len(batch)
                continue
            with self._stats_lock:
                self.peak_engine_pending = max(self.peak_engine_pending, self.engine.num_pending())
            i = 0
            for reqs, f in batch:
                mine = futures[i : i + len(reqs)]
                i += len(reqs)
                task = asyncio.ensure_future(self._resolve(mine, f))
                self._tasks.add(task)  # keep a reference until done (the loop holds tasks weakly)
                task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _resolve(futures: Sequence[Any], out: asyncio.Future) -> None:
        try:
            res = list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException as e:  # noqa: BLE001
            if not out.done():
                out.set_exception(e)
            return
        if not out.done():
            out.set_result(res)

    async def _complete(self, prompt: tuple[int, ...], req: ChatRequest, max_tokens: int) -> list[Completion]:
        from rl.rollout.engine import GenerateRequest

        mode = req.tool_choice.mode
        stops = chat.STOP_TOKEN_IDS
        if mode in ("required", "function"):
            stops = stops + (chat.THINK_END_ID,)  # stop when thinking ends, then force the call
        elif mode == "none":
            stops = stops + (chat.TOOL_CALL_START_ID,)

        def seed(i: int, phase: int) -> int | None:
            return None if req.seed is None else req.seed + 1000 * phase + i

        first = await self._generate([
            GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                            stop_token_ids=stops, thinking_budget=req.thinking_budget, seed=seed(i, 0))
            for i in range(req.n)
        ])
        comps = [Completion(tuple(r.token_ids), tuple(r.logprobs), (1,) * len(r.token_ids), r.finish_reason, r.policy_version) for r in first]
        if mode not in ("required", "function"):
            return comps
        forced = tuple(self.tokenizer.encode(_forced_prefix(req.tool_choice), add_special_tokens=False))
        todo = [i for i, c in enumerate(comps) if c.engine_finish == "stop" and c.token_ids and c.token_ids[-1] == chat.THINK_END_ID
                and max_tokens - len(c.token_ids) - len(forced) > 0]
        if not todo:
            return comps
        second = await self._generate([
            GenerateRequest(prompt_token_ids=prompt + comps[i].token_ids + forced, max_tokens=max_tokens - len(comps[i].token_ids) - len(forced),
                            temperature=req.temperature, top_p=req.top_p, stop_token_ids=chat.STOP_TOKEN_IDS, thinking_budget=None,
                            seed=seed(i, 1))
            for i in todo
        ])
        for i, r in zip(todo, second):
            c = comps[i]
            comps[i] = Completion(
                token_ids=c.token_ids + forced + tuple(r.token_ids),
                logprobs=c.logprobs + (None,) * len(forced) + tuple(r.logprobs),
                loss_mask=c.loss_mask + (0,) * len(forced) + (1,) * len(r.token_ids),
                engine_finish=r.finish_reason, policy_version=r.policy_version)
        return comps

    # -- one request
    async def chat(self, req: ChatRequest) -> tuple[str, int, int, list[Choice]]:
        """Generate the reply; returns (id, created, prompt token count, choices) and records it."""
        try:
            text = chat.render(req.messages, list(req.tools) if req.tools else None, add_generation_prompt=True)
        except (ValueError, TypeError) as e:
            raise _bad(f"messages cannot be rendered in the chat format: {e}", "messages") from None
        prompt = encode_prompt(text, self.tokenizer, self.history)
        n_prompt = len(prompt.token_ids)
        room = self.max_model_len - n_prompt
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; the messages take {n_prompt} "
                                "tokens, which leaves no room for a reply. Shorten the messages.", param="messages",
                           code="context_length_exceeded")
        # max_tokens larger than the room left is clamped (finish_reason "length" says when it bit).
        max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
        with self._stats_lock:
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            comps = await self._complete(prompt.token_ids, req, max_tokens)
        finally:
            with self._stats_lock:
                self.inflight -= 1
        turn = sum(1 for m in req.messages if m.role == "assistant")
        choices = [finish_choice(i, c, self.tokenizer, req, turn) for i, c in enumerate(comps)]
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        for c in choices:
            # Remember only completions the client can send back verbatim: the re-rendered message must be
            # the generated text, else the next prompt would not extend these ids.
            if c.completion.token_ids and c.completion.token_ids[-1] == chat.IM_END_ID and not c.parse_errors:
                if chat.render_completion(c.message) == c.text:
                    self.history.remember(text + c.text, prompt.token_ids + c.completion.token_ids, (rid, c.index))
        with self._stats_lock:
            self.requests += 1
        if self.recorder is not None:
            self.recorder.write(self._record(rid, req, prompt, choices))
        return rid, created, n_prompt, choices

    def _record(self, rid: str, req: ChatRequest, prompt: PromptTokens, choices: Sequence[Choice]) -> ServeRecord:
        request = {
            "messages": list(req.raw_messages),
            "tools": list(req.tools) if req.tools else None,
            "tool_choice": req.tool_choice.mode if req.tool_choice.mode != "function" else {"type": "function", "function": {"name": req.tool_choice.name}},
            "thinking_tier": req.tier, "thinking_budget_tokens": req.thinking_budget,
            "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
            "stop": list(req.stop), "n": req.n, "user": req.user, "metadata": dict(req.metadata) if req.metadata else None,
        }
        return ServeRecord(
            id=rid, created=time.time(), model=req.model,
            policy_version=max((c.completion.policy_version for c in choices), default=0),
            request=request, prompt_token_ids=prompt.token_ids, prompt_reused_tokens=prompt.reused, continues=prompt.continues,
            choices=tuple(
                RecordedChoice(index=c.index, completion_token_ids=c.completion.token_ids, logprobs=c.completion.logprobs,
                               loss_mask=c.completion.loss_mask, finish_reason=c.finish_reason, text=c.text,
                               message=message_json(c.message), parse_errors=c.parse_errors)
                for c in choices
            ),
        )

    def models_json(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_names[0], "object": "model", "created": self.created,
                                            "owned_by": "jointrl", "max_model_len": self.max_model_len}]}


# ============================================================================ the HTTP app
def create_app(service: ChatService):
    """The FastAPI app. Every error reply, including unknown routes, uses the OpenAI error shape."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="jointrl serve", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return JSONResponse(status_code=e.status, content=e.body())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(status_code=e.status_code,
                            content=ApiError(e.status_code, str(e.detail), code=code).body())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return JSONResponse(status_code=400, content=ApiError(400, f"invalid request: {e.errors()}").body())

    @app.exception_handler(Exception)
    async def _server_error(_: Request, e: Exception):
        log.exception("request failed")
        return JSONResponse(status_code=500, content=ApiError(500, f"internal server error: {e!r}", type="server_error").body())

    @app.get("/health")
    async def health():
        return {"status": "ok", "requests": service.requests, "inflight": service.inflight, "peak_inflight": service.peak_inflight,
                "peak_engine_pending": service.peak_engine_pending, "policy_version": service.engine.policy_version}

    @app.get("/v1/models")
    async def models():
        return service.models_json()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in service.model_names:
            raise ApiError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
        return service.models_json()["data"][0]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        req = parse_chat_request(body, service.settings, service.model_names)
        rid, created, n_prompt, choices = await service.chat(req)
        if not req.stream:
            return completion_json(rid, created, req.model, n_prompt, choices, service.tokenizer, req.logprobs)

        async def events() -> AsyncIterator[bytes]:
            for ch in stream_chunks(rid, created, req.model, n_prompt, choices, req.include_usage):
                yield f"data: {json.dumps(ch, ensure_ascii=False)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


# ============================================================================ model preparation
@dataclass(frozen=True)
class PreparedModel:
    path: Path  # HF checkpoint directory (config.json, weights, tokenizer files)
    served_name: str
    dtype: str  # float32 / bfloat16
    is_hybrid: bool


def prepare_model(model_or_ckpt: str, settings: ServeSettings) -> PreparedModel:
    """Resolve the `MODEL_OR_CKPT` argument to a checkpoint directory vLLM can load."""
    from model.shipped import SHIPPED_CONFIGS, build_random_checkpoint

    if model_or_ckpt in SHIPPED_CONFIGS and not Path(model_or_ckpt).is_dir():
        from jointrl.paths import cache_root

        root = Path(settings.cache_dir) if settings.cache_dir else cache_root() / "serve"
        path = build_random_checkpoint(model_or_ckpt, root / f"{model_or_ckpt}-seed{settings.seed}", settings.seed)
        name = model_or_ckpt
    else:
        path = Path(model_or_ckpt)
        if not (path / "config.json").is_file():
            raise ServeError(f"{model_or_ckpt!r} is neither a shipped model config {SHIPPED_CONFIGS} nor a checkpoint directory with config.json")
        name = path.resolve().name
    cfg = json.loads((path / "config.json").read_text())
    is_hybrid = cfg.get("model_type") == "hybrid_moe" or "HybridMoeForCausalLM" in (cfg.get("architectures") or [])
    has_delta = "linear_attention" in (cfg.get("layer_types") or [])
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if has_delta else "float32"  # vLLM's CPU delta-rule kernel requires bf16 (docs/platform.md)
    missing = [f for f in ("tokenizer.json", "tokenizer_config.json") if not (path / f).is_file()]
    if missing:
        raise ServeError(f"{path}: no {missing}; the server needs the project tokenizer next to the weights (copy model/tokenizer/*)")
    return PreparedModel(path=path, served_name=settings.served_name or name, dtype=dtype, is_hybrid=is_hybrid)


def build_service(model_or_ckpt: str, settings: ServeSettings, record_dir: str | None) -> ChatService:
    from rl.rollout.engine import EngineConfig, RolloutEngine

    prepared = prepare_model(model_or_ckpt, settings)
    try:
        tokenizer = chat.load_tokenizer(prepared.path)
    except ValueError as e:
        raise ServeError(f"{prepared.path}: the tokenizer does not carry the project chat format's special tokens ({e})") from None
    engine = RolloutEngine(EngineConfig(
        model_path=str(prepared.path), dtype=prepared.dtype, max_model_len=settings.max_model_len, kv_cache_gib=settings.kv_cache_gib,
        enforce_eager=settings.enforce_eager, seed=settings.seed,
        reasoning_start=chat.REASONING_START_STR, reasoning_end=chat.REASONING_END_STR))
    names = [prepared.served_name] + [n for n in (model_or_ckpt,) if n != prepared.served_name]
    recorder = Recorder(record_dir) if record_dir else None
    if recorder is not None:
        log.info("recording requests to %s", recorder.path)
    return ChatService(engine, tokenizer, settings, names, settings.max_model_len, recorder)


def main(model: str, host: str = "127.0.0.1", port: int = 8000, record_dir: str | None = None,
         settings: ServeSettings | None = None) -> int:
    """Entry point of `jointrl serve MODEL_OR_CKPT --host H --port N [--record-dir D]`; returns an exit code."""
    from rl.log import setup_logging
    from rl.paths import setup_cache_env

    setup_logging()
    setup_cache_env()
    settings = settings or ServeSettings()
    try:
        service = build_service(model, settings, record_dir)
    except ServeError as e:
        print(f"jointrl serve: {e}", file=sys.stderr)
        return 2
    import uvicorn

    app = create_app(service)
    log.info("serving %s on http://%s:%d/v1 (max_model_len %d)", service.model_names[0], host, port, settings.max_model_len)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        service.engine.shutdown()  # type: ignore[attr-defined]
    return 0


def _cli(argv: Sequence[str] | None = None) -> int:
    """`python -m rl.serve`: `jointrl serve` plus the engine settings the main CLI does not expose."""
    p = argparse.ArgumentParser(prog="python -m rl.serve", description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--record-dir", default=None)
    p.add_argument("--max-model-len", type=int, default=ServeSettings.max_model_len)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--kv-cache-gib", type=float, default=ServeSettings.kv_cache_gib)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-name", default=None)
    p.add_argument("--default-tier", choices=list(TIERS), default=ServeSettings.default_tier)
    p.add_argument("--thinking-budgets", default=None, help="e.g. low=64,high=256,max=-1 (default: rl.config RolloutSection)")
    a = p.parse_args(argv)
    budgets = _default_budgets()
    if a.thinking_budgets:
        for item in a.thinking_budgets.split(","):
            k, _, v = item.partition("=")
            if k not in TIERS or not v.lstrip("-").isdigit():
                p.error(f"--thinking-budgets: {item!r} is not TIER=INT with TIER in {TIERS}")
            budgets[k] = int(v)
    try:
        settings = ServeSettings(max_model_len=a.max_model_len, dtype=a.dtype, kv_cache_gib=a.kv_cache_gib, seed=a.seed,
                                 served_name=a.served_name, default_tier=a.default_tier, thinking_budgets=budgets)
    except ServeError as e:
        p.error(str(e))
    return main(a.model, a.host, a.port, a.record_dir, settings)


if __name__ == "__main__":
    sys.exit(_cli())
