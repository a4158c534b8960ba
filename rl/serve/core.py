"""The serving core both wire protocols share: errors, the internal request/reply model, replies, token reuse.

What it does
- `ApiError`: an error reply (status, message, param, code); each protocol renders it in its own shape.
- `ChatRequest`: a validated, protocol-neutral request (messages as `jointrl.records.Message`, tools as
  function schemas, tool choice, thinking budget, sampling). `rl.serve.openai` and
  `rl.serve.anthropic` translate their wire formats to it; `rl.serve.service` runs it.
- `finish_choice`: a finished completion (ids) -> the reply message (parsed by the checkpoint's chat
  codec, `rl.serve.codec.ServeCodec`), finish reason and parse errors.
- Token reuse across turns (`TokenHistory`, `encode_prompt`), on the codec's token ids.
- The engine's ranges, checked before anything reaches it: seeds (int64 in, `engine_seed` in [0, 2**63) out),
  token counts (<= 2**31 - 1), `top_logprobs` (<= 20), body depth (<= 64) and text (no lone surrogates);
  the effort names every route reads (`budget_fields`, `parse_budget_value`), raw-JSON `extra_body`.

What it does not do
- No HTTP, no engine calls, no wire formats, no chat format of its own (rl/serve/codec.py).
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Protocol, Sequence

from jointrl.records import Message
from rl.serve.settings import EFFORTS, TIERS, ServeSettings

if TYPE_CHECKING:
    from rl.serve.codec import ServeCodec

Protocol_ = Literal["openai", "anthropic", "responses"]
IMAGES_REFUSED = ("image input is not supported by this server: the served model has no vision tower (image input is "
                  "HybridMoe's, in the project chat format) or the server runs with --max-images 0; send text only")


def request_image(data: bytes, codec: "ServeCodec", where: str, param: str) -> bytes:
    """Client image bytes checked against the served model's image contract (model/vision.py): a 400 naming
    the content part when the server takes no images (`image_input_unsupported`) or the image is unusable
    (`invalid_image`: undecodable, a side not a multiple of the patch size, too large)."""
    from model.vision import ImageError, decode_image

    if codec.vision is None or codec.max_images == 0:
        raise ApiError(400, f"{where}: {IMAGES_REFUSED}", param=param, code="image_input_unsupported")
    try:
        decode_image(data, codec.vision)
    except ImageError as e:
        raise ApiError(400, f"{where}: {e}", param=param, code="invalid_image") from None
    return data


def base64_image(text: Any, where: str, param: str) -> bytes:
    import base64
    import binascii

    if not isinstance(text, str) or not text:
        raise bad(f"{where}: image data must be a non-empty base64 string", param, "invalid_image")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{where}: image data is not valid base64", param, "invalid_image") from None


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


# Engine ranges. Seeds: the OpenAI API's int64; the engine gets `engine_seed`, in [0, 2**63), which torch's
# generators and vLLM take (a seed of 2**64 once reached the engine and broke every later step).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
# Token counts a client may name (budgets, max_tokens): anything larger is no request a context can hold;
# counts up to this are clamped to the context room, larger ones are refused before any arithmetic.
MAX_TOKEN_COUNT = 2 ** 31 - 1
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_JSON_DEPTH = 64  # nesting of a request body: deeper bodies are refused before any code walks them


def parse_seed(value: Any, param: str = "seed") -> int | None:
    """A request seed: null or an integer in the OpenAI API's int64 range (a 400 otherwise)."""
    if value is None:
        return None
    if not is_int(value) or not SEED_MIN <= value <= SEED_MAX:
        raise bad(f"{param} must be an integer in [{SEED_MIN}, {SEED_MAX}] or null, got {brief(value)}", param)
    return int(value)


def engine_seed(seed: int, phase: int, index: int) -> int:
    """The engine's seed for one phase of one choice: distinct per (phase, choice), always in [0, 2**63)."""
    return (seed + 1000 * phase + index) % (2 ** 63)


def brief(value: Any) -> str:
    """A value for an error message, cut short (a 4,000-digit number or a long string stays readable)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_body_tree(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A decoded JSON body no deeper than `max_depth` and free of lone surrogates (JSON's `\\ud800` escapes,
    which no UTF-8 reply, tokenizer or record can carry); iterative, so no depth can exhaust the stack."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise bad(f"the request body nests deeper than {max_depth} levels", None, "invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                _check_text(k)
                stack.append((v, depth + 1))
        else:
            stack.extend((v, depth + 1) for v in node)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("the request body holds a string with a lone UTF-16 surrogate (not valid Unicode text)", None, "invalid_json") from None


def sampling_numbers(body: Mapping[str, Any], max_temperature: float) -> tuple[float, float]:
    """`temperature` in [0, max_temperature] and `top_p` in (0, 1] of a request body, each 1.0 when absent
    or null (both APIs' default); a 400 naming the field otherwise. The ranges are each API's own."""
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not is_num(temperature) or not 0 <= temperature <= max_temperature:
        raise bad(f"temperature must be a number in [0, {max_temperature:g}], got {brief(temperature)}", "temperature")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not is_num(top_p) or not 0 < top_p <= 1:
        raise bad(f"top_p must be a number in (0, 1], got {brief(top_p)}", "top_p")
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
    top_logprobs: int = 0  # alternatives per token in the reply's logprobs (0..MAX_TOP_LOGPROBS)
    user: str | None = None
    metadata: Mapping[str, Any] | None = None
    protocol: Protocol_ = "openai"
    raw_system: Any = None  # Anthropic's top-level `system`, as received
    # True when the request named no budget (the server's default tier): thinking then leaves room for an
    # answer (ChatService.prepare caps it at half the reply), and a format without a thinking block is not capped.
    default_budget: bool = False


def parse_budget_value(value: Any, param: str, settings: ServeSettings) -> tuple[str | None, int | None]:
    """A `thinking_budget` value (tier name or token count) -> (tier, tokens)."""
    if is_int(value):
        if not 0 <= value <= MAX_TOKEN_COUNT:
            raise bad(f"{param} as a token count must be in [0, {MAX_TOKEN_COUNT}], got {brief(value)}", param)
        return None, int(value)
    if isinstance(value, str) and value in EFFORTS:
        tier = EFFORTS[value]
        return tier, settings.tier_budget(tier)
    raise bad(f"{param} {brief(value)} is not one of {list(EFFORTS)} (or a token count >= 0)", param)


def _parse_budget(body: Mapping[str, Any], settings: ServeSettings) -> tuple[str | None, int | None]:
    tb, effort = body.get("thinking_budget"), body.get("reasoning_effort")
    if tb is not None and effort is not None and parse_budget_value(tb, "thinking_budget", settings) != \
            parse_budget_value(effort, "reasoning_effort", settings):
        raise bad(f"thinking_budget {tb!r} and its alias reasoning_effort {effort!r} disagree; send one", "thinking_budget")
    value = tb if tb is not None else effort
    param = "thinking_budget" if tb is not None else "reasoning_effort"
    if value is None:
        value = settings.default_tier
    return parse_budget_value(value, param, settings)


def budget_fields(body: Mapping[str, Any], settings: ServeSettings) -> tuple[str | None, int | None, bool]:
    """(tier, tokens, default) of a body's `thinking_budget` / `reasoning_effort`; default: neither was sent."""
    tier, budget = _parse_budget(body, settings)
    return tier, budget, body.get("thinking_budget") is None and body.get("reasoning_effort") is None


def parse_max_tokens(value: Any, param: str) -> int | None:
    """`max_tokens` (or an alias): null or an integer in [1, MAX_TOKEN_COUNT]; the context room clamps it later."""
    if value is None:
        return None
    if not is_int(value) or not 1 <= value <= MAX_TOKEN_COUNT:
        raise bad(f"{param} must be an integer in [1, {MAX_TOKEN_COUNT}], got {brief(value)}", param)
    return int(value)


def merge_extra_body(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """`extra_body` as raw JSON: the SDKs send its keys at the top level, a raw-JSON client nests them. Read as
    top-level fields; a key given both ways with different values is a 400."""
    extra = body.get("extra_body")
    if extra is None:
        return body
    if not isinstance(extra, Mapping):
        raise bad("extra_body must be an object (its keys are read as top-level request fields)", "extra_body")
    clash = sorted(k for k in extra if k in body and body[k] != extra[k])
    if clash:
        raise bad(f"extra_body sets {clash} to values other than the top-level fields of the same name; send one", "extra_body")
    return {**{k: v for k, v in body.items() if k != "extra_body"}, **extra}


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
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token (token id, logprob) alternatives, when asked for; () on forced tokens

    def __post_init__(self) -> None:
        if self.top and len(self.top) != len(self.token_ids):
            raise ValueError(f"Completion: {len(self.token_ids)} ids, {len(self.top)} top-logprob entries")
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


def finish_choice(index: int, comp: Completion, codec: "ServeCodec", req: ChatRequest, turn: int) -> Choice:
    """Decode, apply stop strings and tool_choice, parse into an assistant message (the codec's parser)."""
    tokenizer = codec.tokenizer
    ids = comp.token_ids
    ends = token_text_ends(tokenizer, ids)
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    finish: str = "length" if comp.engine_finish == "length" else "stop"
    cut = first_stop(text, req.stop)
    call_marker = codec.refused_call_marker(req.tool_choice.mode, bool(req.tools))
    at = text.find(call_marker) if call_marker else -1
    if at >= 0 and (cut is None or at < cut[0]):
        # tool_choice none: generation was stopped at the opening of a tool call; the reply ends before it.
        cut = (at, at + len(call_marker), None)
    stop_string = None
    if cut is not None:
        # Like a stop string in vLLM: the reply ends before it; the ids end with the token completing it
        # (tokens after it, generated in the same engine step, are dropped).
        keep = next(i + 1 for i, e in enumerate(ends) if e >= cut[1])
        comp = replace(comp, token_ids=ids[:keep], logprobs=comp.logprobs[:keep], loss_mask=comp.loss_mask[:keep], engine_finish="stop",
                       top=comp.top[:keep])
        ids, ends = comp.token_ids, ends[:keep]
        text, finish, stop_string = text[: cut[0]], "stop", cut[2]
        if stop_string is None and text.endswith("\n"):  # the separator the format puts before a tool call
            text = text[:-1]
    ends = tuple(min(e, len(text)) for e in ends)
    # A cut reply is parsed from its text (the ids run past the cut); the record keeps the ids.
    parse_ids = ids if cut is None else tokenizer.encode(text, add_special_tokens=False)
    parsed = codec.parse(parse_ids, turn, req.tools if req.tool_choice.mode != "none" else None)
    msg = parsed.message
    errors = parsed.errors
    if req.tools and msg.tool_calls:
        # A call to a tool the request did not offer is no call a client can run: dropped and reported.
        offered = {t["function"]["name"] for t in req.tools}
        unknown = [c for c in msg.tool_calls if c.name not in offered]
        if unknown:
            kept = [replace(c, id=f"call_{turn}_{j}") for j, c in enumerate(c for c in msg.tool_calls if c.name in offered)]
            msg = replace(msg, tool_calls=tuple(kept))
            errors = errors + tuple(f"tool call to {c.name[:80]!r}, which is not among the request's tools {sorted(offered)}" for c in unknown)
    if req.tool_choice.mode in ("required", "function") and not msg.tool_calls and finish != "length":
        errors = errors + (f"tool_choice {req.tool_choice.mode!r}: the reply holds no valid call to the request's tools",)
    if req.tool_choice.mode == "none" and msg.tool_calls:
        msg = replace(msg, tool_calls=())  # cannot happen after the cut above; kept as a guarantee
    if msg.tool_calls and finish == "stop":
        finish = "tool_calls"
    marker = codec.reasoning_end
    close = text.find(marker) if marker else -1
    if close >= 0:
        reasoning_tokens = sum(1 for e in ends if e <= close)  # the tokens before the end-of-thinking marker
    else:
        reasoning_tokens = len(ids) if msg.reasoning is not None and not msg.content and not msg.tool_calls else 0
    return Choice(index=index, completion=comp, text=text, message=msg, finish_reason=finish,  # type: ignore[arg-type]
                  parse_errors=errors, reasoning_tokens=reasoning_tokens, token_ends=ends, stop_string=stop_string)


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


def _prefix_digests(ids: Sequence[int], ends: frozenset[int]) -> list[tuple[int, bytes]]:
    """(n, sha256 of ids[:n]) for every n just after an end-of-turn id, in one pass."""
    h = hashlib.sha256()
    out, last = [], 0
    for i, t in enumerate(ids):
        if t in ends:
            h.update(array("q", ids[last: i + 1]).tobytes())
            last = i + 1
            out.append((last, h.copy().digest()))
    return out


class TokenHistory:
    """Remembers `the codec's ids of a conversation up to a reply -> the ids the engine saw and sampled`, for reuse next turn.

    Keys are the codec's own rendering (prompt ids + `completion_ids` of the parsed reply), which
    ends with an end-of-turn id. A later request whose rendered prompt starts with such a key, cut
    just after an end-of-turn id, reuses the stored ids and appends the rest of its own rendering:
    a cut right after a special token cannot merge with what follows. The service stores a reply only
    when its rendering decodes to the generated text, so reuse swaps a re-tokenisation for the sampled
    ids of the same text. A bounded LRU; thread-safe.
    """

    def __init__(self, capacity: int, end_ids: Iterable[int]) -> None:
        self.capacity = capacity
        self.end_ids = frozenset(int(i) for i in end_ids)
        self._entries: OrderedDict[bytes, tuple[tuple[int, ...], tuple[str, int]]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, rendered: Sequence[int], token_ids: Sequence[int], source: tuple[str, int]) -> None:
        if self.capacity <= 0 or not rendered or rendered[-1] not in self.end_ids:
            return
        k = _prefix_digests(rendered, self.end_ids)[-1][1]
        with self._lock:
            self._entries[k] = (tuple(token_ids), source)
            self._entries.move_to_end(k)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def longest_prefix(self, rendered: Sequence[int]) -> tuple[int, tuple[int, ...], tuple[str, int]] | None:
        """(rendered ids covered, stored ids, source) of the longest stored key that `rendered` starts with."""
        digests = _prefix_digests(rendered, self.end_ids)
        with self._lock:
            for n, k in reversed(digests):
                hit = self._entries.get(k)
                if hit is not None:
                    self._entries.move_to_end(k)
                    return n, hit[0], hit[1]
        return None

    def __len__(self) -> int:
        return len(self._entries)


def encode_prompt(rendered: Sequence[int], history: TokenHistory | None) -> PromptTokens:
    """The ids to send: `rendered` (the codec's prompt ids), its longest remembered head swapped for the sampled ids."""
    hit = history.longest_prefix(rendered) if history is not None else None
    if hit is None:
        return PromptTokens(tuple(rendered))
    n, ids, source = hit
    return PromptTokens(tuple(ids) + tuple(rendered[n:]), reused=len(ids), continues=source)
