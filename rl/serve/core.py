"""The serving core both wire protocols share: settings, errors, the internal request/reply model, the chat-codec seam.

What it does
- `ApiError`: an error reply (status, message, param, code); each protocol renders it in its own shape.
- `ChatRequest`: a validated, protocol-neutral request (messages as `jointrl.records.Message`, tools as
  function schemas, tool choice, thinking budget, sampling). `rl.serve.openai` and
  `rl.serve.anthropic` translate their wire formats to it; `rl.serve.service` runs it.
- `ChatCodec`: the one seam through which the service renders prompts and parses completions
  (`ProjectChatCodec` wraps `model/chat.py`); a per-checkpoint codec plugs in here.
- `finish_choice`: a finished completion (ids) -> the reply message, finish reason and parse errors.
- `StreamFields`: the prefix of the reasoning / content fields that is final while tokens still arrive,
  so both protocols can stream deltas that join to exactly the finished message.
- Token reuse across turns (`TokenHistory`, `encode_prompt`).

What it does not do
- No HTTP, no engine calls, no wire formats.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Protocol, Sequence

from jointrl.records import Message
from model import chat
from rl.serve.settings import TIERS, ServeSettings

Protocol_ = Literal["openai", "anthropic"]
IMAGES_REFUSED = ("image input is not supported by this server yet: the served model has no vision input path "
                  "(multimodal serving is a separate change); send text only")


# ============================================================================ errors
class ApiError(Exception):
    """An error reply; raised by request validation and rendered by the app in the route's error shape.

    `type` is the OpenAI error type; the Anthropic shape derives its own type from the status.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI error shape."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def sampling_numbers(body: Mapping[str, Any], max_temperature: float) -> tuple[float, float]:
    """`temperature` in [0, max_temperature] and `top_p` in (0, 1] of a request body, each 1.0 when absent
    or null (both APIs' default); a 400 naming the field otherwise. The ranges are each API's own."""
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not is_num(temperature) or not 0 <= temperature <= max_temperature:
        raise bad(f"temperature must be a number in [0, {max_temperature:g}], got {temperature!r}", "temperature")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not is_num(top_p) or not 0 < top_p <= 1:
        raise bad(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    return temperature, top_p


# ============================================================================ the internal request
@dataclass(frozen=True)
class ToolChoice:
    """mode `function` names one tool; the others carry no name."""

    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat request, whichever protocol it came in."""

    model: str
    messages: tuple[Message, ...]
    raw_messages: tuple[Any, ...]  # as received, for the record
    tools: tuple[Mapping[str, Any], ...] | None  # OpenAI function schemas (what the codec renders)
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
    protocol: Protocol_ = "openai"
    raw_system: Any = None  # Anthropic's top-level `system`, as received


def parse_budget_value(value: Any, param: str, settings: ServeSettings) -> tuple[str | None, int | None]:
    """A `thinking_budget` value (tier name or token count) -> (tier, tokens)."""
    if is_int(value):
        if value < 0:
            raise bad(f"{param} as a token count must be >= 0, got {value}", param)
        return None, int(value)
    if isinstance(value, str) and value in TIERS:
        return value, settings.tier_budget(value)
    raise bad(f"{param} {value!r} is not one of {list(TIERS)} (or a token count >= 0)", param)


def check_limits(req_messages: int, max_tokens: Any, settings: ServeSettings, mparam: str) -> None:
    if req_messages > settings.max_messages:
        raise bad(f"messages has {req_messages} entries; this server accepts at most {settings.max_messages} (--max-messages)",
                  "messages", "too_many_messages")
    if settings.max_tokens_limit is not None and is_int(max_tokens) and max_tokens > settings.max_tokens_limit:
        raise bad(f"{mparam} {max_tokens} is over this server's limit of {settings.max_tokens_limit} (--max-tokens-limit)",
                  mparam, "max_tokens_over_limit")


def check_model(model: Any, names: Sequence[str]) -> str:
    if model is None:
        return names[0]
    if not isinstance(model, str):
        raise bad("model must be a string", "model")
    if model not in names:
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {list(names)} (see /v1/models)",
                       param="model", code="model_not_found")
    return model


# ============================================================================ the chat-codec seam
@dataclass(frozen=True)
class ParsedCompletion:
    message: Message
    errors: tuple[str, ...]


class ChatCodec(Protocol):
    """Everything the service needs to know about a checkpoint's chat format."""

    stop_token_ids: tuple[int, ...]  # end of turn
    think_end_id: int
    tool_call_start_id: int
    end_of_turn_id: int
    end_of_turn: str

    def render_prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> str: ...

    def render_completion(self, message: Message) -> str: ...

    def parse_completion(self, text: str, turn: int) -> ParsedCompletion: ...

    def forced_call_prefix(self, name: str | None) -> str: ...

    def defuse(self, text: str) -> str: ...

    def stream_fields(self, text: str, holdback: Sequence[str]) -> "StreamFields": ...


@dataclass(frozen=True)
class StreamFields:
    """The part of the reply's reasoning / content that is final, given the completion text so far.

    `thinking_closed`: reasoning is complete. `tool_call_started`: content is complete.
    """

    reasoning: str
    content: str
    thinking_closed: bool
    tool_call_started: bool


def _hold(s: str, markers: Sequence[str]) -> str:
    """`s` without the longest suffix that could still grow into one of `markers` (never final yet)."""
    cut = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(s)), 0, -1):
            if s.endswith(m[:k]):
                cut = max(cut, k)
                break
    return s[: len(s) - cut] if cut else s


class ProjectChatCodec:
    """The project chat format (`model/chat.py`)."""

    stop_token_ids = chat.STOP_TOKEN_IDS
    think_end_id = chat.THINK_END_ID
    tool_call_start_id = chat.TOOL_CALL_START_ID
    end_of_turn_id = chat.IM_END_ID
    end_of_turn = chat.IM_END_TOKEN

    def render_prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> str:
        return chat.render(messages, list(tools) if tools else None, add_generation_prompt=True)

    def render_completion(self, message: Message) -> str:
        return chat.render_completion(message)

    def parse_completion(self, text: str, turn: int) -> ParsedCompletion:
        p = chat.parse_assistant(text, turn)
        return ParsedCompletion(p.message, p.errors)

    def forced_call_prefix(self, name: str | None) -> str:
        """Text appended after `</think>` to make the model call a tool (the chat format's call layout)."""
        head = f"\n\n{chat.TOOL_CALL_START_TOKEN}\n" + '{"name": '
        if name is not None:
            return head + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        return head + '"'

    def defuse(self, text: str) -> str:
        return chat.defuse(text)

    def stream_fields(self, text: str, holdback: Sequence[str]) -> StreamFields:
        """Mirror of `chat.parse_assistant`'s split, keeping back whatever later text could still change.

        A trailing "\\n" is held (the parser drops one before `</think>` and `<tool_call>`), and so is
        any suffix that could become a marker or a stop string (`holdback`).
        """
        markers = (chat.THINK_END_TOKEN, chat.IM_END_TOKEN, chat.TOOL_CALL_START_TOKEN, *holdback)
        body = text[1:] if text.startswith("\n") else text
        if not text:
            return StreamFields("", "", False, False)
        end = body.find(chat.IM_END_TOKEN)
        if end >= 0:
            body = body[:end]
        close = body.find(chat.THINK_END_TOKEN)
        if close < 0:
            r = _hold(body, markers) if end < 0 else body
            return StreamFields(r[:-1] if r.endswith("\n") else r, "", False, False)
        reasoning = body[:close]
        reasoning = reasoning[:-1] if reasoning.endswith("\n") else reasoning
        rest = body[close + len(chat.THINK_END_TOKEN):]
        if end < 0 and rest in ("", "\n"):
            return StreamFields(reasoning, "", True, False)  # "\n" may still become the "\n\n" separator
        rest = rest[2:] if rest.startswith("\n\n") else rest[1:] if rest.startswith("\n") else rest
        first = rest.find(chat.TOOL_CALL_START_TOKEN)
        if first >= 0:
            content = rest[:first]
            return StreamFields(reasoning, content[:-1] if content.endswith("\n") else content, True, True)
        c = _hold(rest, markers) if end < 0 else rest
        if end < 0 and c.endswith("\n"):
            c = c[:-1]
        return StreamFields(reasoning, c, True, False)


DEFAULT_CODEC = ProjectChatCodec()


# ============================================================================ completions -> replies
@dataclass(frozen=True)
class Completion:
    """Everything appended after the prompt for one choice: generated ids (mask 1) and forced ids (mask 0)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]  # None on forced tokens
    loss_mask: tuple[int, ...]
    engine_finish: str  # the last engine call's finish reason: stop / length / abort
    policy_version: int = 0
    stop_string: str | None = None  # the stop string that ended generation, if one did

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
    stop_string: str | None = None  # which stop string cut the reply


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


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


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """(start, end, string) of the earliest stop string in `text`, or None."""
    hits = [(p, p + len(s), s) for p, s in ((text.find(s), s) for s in stops) if p >= 0]
    return min(hits) if hits else None


def finish_choice(index: int, comp: Completion, tokenizer: TokenizerLike, req: ChatRequest, turn: int,
                  codec: ChatCodec = DEFAULT_CODEC) -> Choice:
    """Decode, apply stop strings and tool_choice, parse into an assistant message."""
    ids = comp.token_ids
    ends = token_text_ends(tokenizer, ids)
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    finish: str = "length" if comp.engine_finish == "length" else "stop"
    if req.tool_choice.mode == "none" and ids and ids[-1] == codec.tool_call_start_id and comp.engine_finish == "stop":
        # Generation was stopped at the opening of a tool call: the reply ends before it.
        text = text[: ends[-2]] if len(ends) > 1 else ""
        if text.endswith("\n"):  # the separator the format puts between content and a tool call
            text = text[:-1]
        finish = "stop"
    cut = first_stop(text, req.stop)
    stop_string = None
    if cut is not None:
        # Like a stop string in vLLM: the reply ends before it; the ids end with the token completing it
        # (tokens after it, generated in the same engine step, are dropped).
        keep = next(i + 1 for i, e in enumerate(ends) if e >= cut[1])
        comp = replace(comp, token_ids=ids[:keep], logprobs=comp.logprobs[:keep], loss_mask=comp.loss_mask[:keep], engine_finish="stop")
        ids, ends = comp.token_ids, ends[:keep]
        text, finish, stop_string = text[: cut[0]], "stop", cut[2]
    ends = tuple(min(e, len(text)) for e in ends)
    parsed = codec.parse_completion(text, turn)
    msg = parsed.message
    if req.tool_choice.mode == "none" and msg.tool_calls:
        msg = replace(msg, tool_calls=())  # cannot happen after the stop above; kept as a guarantee
    if msg.tool_calls and finish == "stop":
        finish = "tool_calls"
    reasoning_tokens = ids.index(codec.think_end_id) if codec.think_end_id in ids else len(ids)
    return Choice(index=index, completion=comp, text=text, message=msg, finish_reason=finish,  # type: ignore[arg-type]
                  parse_errors=parsed.errors, reasoning_tokens=reasoning_tokens, token_ends=ends, stop_string=stop_string)


def thinking_signature(reasoning: str) -> str:
    """The opaque `signature` of an Anthropic thinking block: a digest of its text (lets clients tell blocks apart)."""
    return hashlib.sha256(reasoning.encode("utf-8", "surrogatepass")).hexdigest()[:32]


# ============================================================================ token reuse across turns
@dataclass(frozen=True)
class PromptTokens:
    """A request's prompt ids. The first `reused` ids are an earlier completion's exact ids (from `continues`)."""

    token_ids: tuple[int, ...]
    reused: int = 0
    continues: tuple[str, int] | None = None  # (record id, choice index)


class TokenHistory:
    """Remembers `prompt text + generated text -> the ids the engine saw and sampled`, for reuse next turn.

    Only completions that ended with the end-of-turn token are stored, keyed by their full text. A
    later prompt text that extends a stored text exactly at such a boundary reuses the stored ids and
    tokenises only the rest - the rest starts with "\\n" right after a special token, so tokenising it
    alone gives the ids tokenising the whole would (chat format guarantee, docs/chat_format.md). A
    bounded LRU; thread-safe.
    """

    def __init__(self, capacity: int, end_of_turn: str = chat.IM_END_TOKEN) -> None:
        self.capacity = capacity
        self.end_of_turn = end_of_turn
        self._entries: OrderedDict[str, tuple[tuple[int, ...], tuple[str, int]]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def remember(self, text: str, token_ids: Sequence[int], source: tuple[str, int]) -> None:
        if self.capacity <= 0 or not text.endswith(self.end_of_turn):
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
        pos = text.find(self.end_of_turn)
        while pos >= 0:
            ends.append(pos + len(self.end_of_turn))
            pos = text.find(self.end_of_turn, pos + 1)
        with self._lock:
            for end in reversed(ends):
                hit = self._entries.get(self._key(text[:end]))
                if hit is not None:
                    self._entries.move_to_end(self._key(text[:end]))
                    return end, hit[0], hit[1]
        return None

    def __len__(self) -> int:
        return len(self._entries)


def encode_prompt(text: str, tokenizer: TokenizerLike, history: TokenHistory | None) -> PromptTokens:
    hit = history.longest_prefix(text) if history is not None else None
    if hit is None:
        return PromptTokens(tuple(tokenizer.encode(text, add_special_tokens=False)))
    chars, ids, source = hit
    rest = tokenizer.encode(text[chars:], add_special_tokens=False) if chars < len(text) else []
    return PromptTokens(tuple(ids) + tuple(rest), reused=len(ids), continues=source)
