"""How the server speaks a checkpoint's chat format: the rollout chat codecs (rl/rollout/codec) seen from serving.

What it does
- `build_codec(checkpoint_dir, settings)`: picks the codec the way training does (rl/runtime.py
  `build_codec`): `--chat-codec auto` follows the checkpoint (`resolve_codec_name`: `jointrl` for the
  shipped tokenizer or none, `hf` for a checkpoint with a chat template of its own), with
  `--tool-parser` / `--reasoning-parser` for `hf`; parser flags on a `jointrl` server are refused as dead.
- `ServeCodec`: the serving view of one codec. Prompts and SFT-style completions are the codec's own
  token ids (`prompt_ids`, `completion_ids`: the template's rendering, token-exact); replies are parsed
  by the codec (`parse`: model/chat.py's parser, or vLLM's tool / reasoning parsers), with one serving
  rule on top: a tool call whose arguments are not a JSON object (or whose name is empty) is dropped
  with a parse error, since both wire protocols promise objects. On top of the codec it knows the
  format's markers, which the service needs while tokens still arrive:
  - `stream_fields(text, holdback, tools)`: the part of reasoning / content that is final so far;
    for `jointrl` an exact mirror of `chat.parse_assistant`, for `hf` a marker split whose rules are
    checked against the codec's own parser when the codec is built (probe replies); a format whose
    probes do not fit (harmony) streams nothing until the reply is parsed.
  - `forced_call_prefix(name, after_reasoning)`: the text that opens a tool call (tool_choice
    required / named): the project format's, or Hermes's for the `hermes` tool parser; None otherwise.
  - `defuse(text)`, `defuse_message`, `defuse_tool`: break every structure string of the format
    (`structure_strings`: the codec's turn markers, every added token of the tokenizer, the parsers' and the
    Hermes presentation's text markers) in client text, so no client text can forge turns, thinking, calls
    or tool results.

What it does not do
- Render or parse a format itself (the codec does), HTTP, or engine calls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from jointrl.records import Message
from model import chat
from rl.rollout.codec import AUTO, ChatCodec, CodecError, ParsedTurn, TextFormatCodec, make_codec, resolve_codec_name
from rl.serve.settings import ServeError, ServeSettings

HERMES_PARSER = "hermes"


@dataclass(frozen=True)
class StreamFields:
    """The part of the reply's reasoning / content that is final, given the completion text so far."""

    reasoning: str
    content: str


EMPTY_FIELDS = StreamFields("", "")


def _hold(s: str, markers: Sequence[str]) -> str:
    """`s` without the longest suffix that could still grow into one of `markers` (never final yet)."""
    cut = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(s)), 0, -1):
            if s.endswith(m[:k]):
                cut = max(cut, k)
                break
    return s[: len(s) - cut] if cut else s


@dataclass(frozen=True)
class MarkerRules:
    """How an `hf` codec's parser splits a reply, as far as streaming needs it (checked by `_probe_rules`).

    The parser cuts the text at the first stop-token string, takes what follows a reasoning start
    marker, splits reasoning from content at the end marker (text without one is all reasoning when
    `unclosed_is_reasoning`, else all content), ends content at the tool-call start marker when the
    request has tools, and strips whitespace around both fields.
    """

    stops: tuple[str, ...]
    reasoning: tuple[str, str] | None
    unclosed_is_reasoning: bool
    tool_call_start: str | None


class ServeCodec:
    """A rollout `ChatCodec` plus what serving needs while a reply streams (see the module docstring)."""

    def __init__(self, codec: ChatCodec) -> None:
        self.codec = codec
        self.name = codec.name
        self.tokenizer = codec.tokenizer
        self.stop_token_ids = tuple(codec.stop_token_ids)
        self.end_token_id = int(codec.end_token_id)
        # Single-token thinking markers (vLLM thinking budgets need them); None: the format has no budgetable thinking.
        self.reasoning_markers = codec.reasoning_markers
        self.reasoning_end_id = self._one_id(codec.reasoning_markers[1]) if codec.reasoning_markers else None
        self.is_project_format = isinstance(codec, TextFormatCodec) and codec.fmt is chat
        self._tool_parser = getattr(codec, "tool_parser_name", "") if codec.name == "hf" else ""
        self.rules: MarkerRules | None = None
        if self.is_project_format:
            self.reasoning_end: str | None = chat.THINK_END_TOKEN
            self.tool_call_start: str | None = chat.TOOL_CALL_START_TOKEN
        else:
            self.rules = _probe_rules(self)
            self.reasoning_end = self.rules.reasoning[1] if self.rules and self.rules.reasoning else None
            self.tool_call_start = self.rules.tool_call_start if self.rules else None
        self.tool_call_start_id = self._one_id(self.tool_call_start) if self.tool_call_start else None
        self._specials = tuple(sorted({s for s in self._structure_strings() if len(s) > 2}, key=len, reverse=True))
        # Image input (set by build_codec): the checkpoint's image contract and the per-request limit; None / 0:
        # the server refuses images (no vision tower, another chat format, or --max-images 0).
        self.vision: Any = None
        self.max_images = 0

    def _structure_strings(self) -> set[str]:
        """Every string that would mean structure in this format, were it in client text: the codec's own
        (turn markers), every token the tokenizer adds to its vocabulary (special or not: `<think>`,
        `<tool_call>`, `<tool_response>`, images, ...), and the text markers the format's parsers and tool
        presentation read (reasoning start / end, the tool call's opening and closing, Hermes's
        `<tools>` and `<tool_response>` wrappers, which a template without a tool section writes as text)."""
        out = set(self.codec.special_strings)
        if self.is_project_format:
            out.update(chat.SPECIAL_TOKENS)
        added = getattr(self.tokenizer, "get_added_vocab", None)
        if added is not None:
            out.update(t for t in added() if isinstance(t, str))
        out.update(getattr(self.tokenizer, "all_special_tokens", None) or ())
        if self.reasoning_markers:
            out.update(self.reasoning_markers)
        if self.rules is not None and self.rules.reasoning:
            out.update(self.rules.reasoning)
        if self.tool_call_start:
            out.add(self.tool_call_start)
        if self._tool_parser == HERMES_PARSER or self.is_project_format:
            out.update(("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"))
        return {t for t in out if isinstance(t, str) and t.strip()}

    @property
    def structure_strings(self) -> tuple[str, ...]:
        """What `defuse` breaks in client text, longest first."""
        return self._specials

    def _one_id(self, s: str) -> int | None:
        ids = self.tokenizer.encode(s, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 else None

    def describe(self) -> str:
        if self.name != "hf":
            return self.name
        rp = getattr(self.codec, "reasoning_parser_name", "") or "none"
        return f"hf (tool parser {self._tool_parser!r}, reasoning parser {rp!r})"

    # -- rendering (the codec's own ids)
    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
        return list(self.codec.prompt_ids(list(messages), [dict(t) for t in tools] if tools else None))

    def completion_ids(self, history: Sequence[Message], message: Message, tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
        return list(self.codec.completion_ids(list(history), message, [dict(t) for t in tools] if tools else None))

    def defuse(self, text: str) -> str:
        """Client text with every structure string broken up (chat.defuse: a zero-width space inside it)."""
        return chat.defuse(text, self._specials) if self._specials else text

    def defuse_message(self, m: Message) -> Message:
        """A message whose every client-written text (content, reasoning, tool-call arguments) is defused.
        Arguments stay valid JSON: structure strings only occur inside JSON strings."""
        calls = tuple(replace(c, arguments=self.defuse(c.arguments)) for c in m.tool_calls)
        return replace(m, content=self.defuse(m.content), reasoning=self.defuse(m.reasoning) if m.reasoning else m.reasoning,
                       tool_calls=calls)

    def defuse_tool(self, tool: Mapping[str, Any]) -> Mapping[str, Any]:
        """A tool schema with every string in it defused (names, descriptions, enum values, property names)."""
        def walk(v: Any) -> Any:
            if isinstance(v, str):
                return self.defuse(v)
            if isinstance(v, Mapping):
                return {walk(k): walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            return v

        return walk(tool)

    # -- parsing
    def parse(self, token_ids: Sequence[int], turn: int, tools: Sequence[Mapping[str, Any]] | None) -> ParsedTurn:
        """The codec's parse, then tool calls both protocols can carry: a non-empty name and JSON-object arguments."""
        p = self.codec.parse(list(token_ids), turn, [dict(t) for t in tools] if tools else None)
        calls = p.message.tool_calls
        kept, errors = [], []
        for i, c in enumerate(calls):
            try:
                args = json.loads(c.arguments)
            except (ValueError, RecursionError):  # a parser that passes on what it could not decode
                args = None
            if not c.name or not isinstance(c.name, str):
                errors.append(f"tool call {i}: no function name")
            elif not isinstance(args, dict):
                errors.append(f"tool call {i} ({c.name}): arguments are not a JSON object: {c.arguments[:200]!r}")
            else:
                kept.append(c)
        if not errors:
            return p
        # Ids stay `call_<turn>_<i>` over the calls that remain, as the codecs number well-formed calls.
        kept = [replace(c, id=f"call_{turn}_{j}") for j, c in enumerate(kept)]
        return ParsedTurn(message=replace(p.message, tool_calls=tuple(kept)), errors=p.errors + tuple(errors),
                          call_errors=p.call_errors + tuple(errors), ended=p.ended)

    # -- tool_choice forcing
    def forced_call_prefix(self, name: str | None, after_reasoning: bool) -> str | None:
        """Text that opens a tool call (naming `name` when given; else up to the name's opening quote), or
        None when the format's call layout is not one the server can force."""
        if self.is_project_format:
            head = f"\n\n{chat.TOOL_CALL_START_TOKEN}\n"
        elif self._tool_parser == HERMES_PARSER and self.tool_call_start == "<tool_call>":
            head = ("\n\n" if after_reasoning else "") + "<tool_call>\n"
        else:
            return None
        head += '{"name": '
        if name is not None:
            return head + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        return head + '"'

    @property
    def call_close(self) -> str:
        """What follows a forced call's JSON object: the closing marker of the layouts `forced_call_prefix` writes."""
        return "\n" + (chat.TOOL_CALL_END_TOKEN if self.is_project_format else "</tool_call>")

    def refused_call_marker(self, mode: str, has_tools: bool) -> str | None:
        """With tool_choice none, the text at which a reply is cut (a tool call's opening), else None. The
        project format's parser reads calls whether or not the request sent tools; an hf parser only when it did."""
        if mode != "none" or not self.tool_call_start:
            return None
        return self.tool_call_start if (has_tools or self.is_project_format) else None

    # -- streaming
    def stream_fields(self, text: str, holdback: Sequence[str], tools: bool) -> StreamFields:
        """The final part of the reasoning / content fields given the completion text so far.

        `holdback`: strings that could still end the reply (stop strings): a suffix that could grow
        into one is not final. `tools`: the request has tools the parser reads (content ends at a call).
        """
        if self.is_project_format:
            return _project_fields(text, holdback)
        if self.rules is None:
            return EMPTY_FIELDS  # a format the split does not know: the whole reply comes when it is parsed
        return _marker_fields(self.rules, text, holdback, tools)


def _project_fields(text: str, holdback: Sequence[str]) -> StreamFields:
    """Mirror of `chat.parse_assistant`'s split, keeping back whatever later text could still change.

    A trailing "\\n" is held (the parser drops one before `</think>` and `<tool_call>`), and so is any
    suffix that could become a marker or a stop string (`holdback`).
    """
    markers = (chat.THINK_END_TOKEN, chat.IM_END_TOKEN, chat.TOOL_CALL_START_TOKEN, *holdback)
    body = text[1:] if text.startswith("\n") else text
    if not text:
        return EMPTY_FIELDS
    end = body.find(chat.IM_END_TOKEN)
    if end >= 0:
        body = body[:end]
    close = body.find(chat.THINK_END_TOKEN)
    if close < 0:
        r = _hold(body, markers) if end < 0 else body
        return StreamFields(r[:-1] if r.endswith("\n") else r, "")
    reasoning = body[:close]
    reasoning = reasoning[:-1] if reasoning.endswith("\n") else reasoning
    rest = body[close + len(chat.THINK_END_TOKEN):]
    if end < 0 and rest in ("", "\n"):
        return StreamFields(reasoning, "")  # "\n" may still become the "\n\n" separator
    rest = rest[2:] if rest.startswith("\n\n") else rest[1:] if rest.startswith("\n") else rest
    first = rest.find(chat.TOOL_CALL_START_TOKEN)
    if first >= 0:
        content = rest[:first]
        return StreamFields(reasoning, content[:-1] if content.endswith("\n") else content)
    c = _hold(rest, markers) if end < 0 else rest
    if end < 0 and c.endswith("\n"):
        c = c[:-1]
    return StreamFields(reasoning, c)


def _marker_fields(rules: MarkerRules, text: str, holdback: Sequence[str], tools: bool) -> StreamFields:
    """The `MarkerRules` split. A field not yet final loses any suffix that could grow into a marker and
    its trailing whitespace (the parser strips it), so what is sent is always a prefix of the parsed field.
    Text that a later marker could still move to the other field (no end marker yet where unclosed text
    is content; content of a request with tools whose call opening the probes could not confirm) is
    not sent until the reply is parsed."""
    body, ended = text, False
    for s in rules.stops:
        at = body.find(s)
        if at >= 0:
            body, ended = body[:at], True
    markers = [*rules.stops, *holdback]
    if rules.reasoning:
        markers += rules.reasoning
    if tools and rules.tool_call_start:
        markers.append(rules.tool_call_start)

    def field(s: str) -> str:
        return s.strip() if ended else _hold(s, markers).strip()

    reasoning, region = "", body
    if rules.reasoning:
        start, end = rules.reasoning
        if start in body:
            body = body.split(start, 1)[1]
        close = body.find(end)
        if close >= 0:
            reasoning, region = body[:close].strip(), body[close + len(end):]
        elif rules.unclosed_is_reasoning:
            return StreamFields(field(body), "")
        else:
            return EMPTY_FIELDS
    if tools:
        at = region.find(rules.tool_call_start) if rules.tool_call_start else -1
        if at >= 0:
            return StreamFields(reasoning, region[:at].strip())
        if rules.tool_call_start is None:
            return StreamFields(reasoning, "")
    return StreamFields(reasoning, field(region))


def _probe_rules(sc: ServeCodec) -> MarkerRules | None:
    """The `MarkerRules` of an `hf` codec, each rule confirmed by parsing a probe reply with the codec
    itself; None when the codec is not `hf`, uses harmony, or a probe parses otherwise."""
    codec = sc.codec
    if codec.name != "hf" or getattr(codec, "tool_parser_name", "") == "openai":
        return None
    tok = sc.tokenizer
    stops = tuple(dict.fromkeys(tok.decode([i], skip_special_tokens=False) for i in codec.stop_token_ids))
    reasoning = _parser_markers(codec, tok)
    tool_start = _tool_call_start(codec, tok)
    tools = [{"type": "function", "function": {"name": "probe_fn", "parameters": {"type": "object", "properties": {}}}}]

    def parse(text: str, with_tools: bool = False) -> Message:
        ids = tok.encode(text, add_special_tokens=False) + [codec.end_token_id]
        return codec.parse(ids, 0, tools if with_tools else None).message

    def fields(m: Message) -> tuple[str, str]:
        return (m.reasoning or "", m.content)

    unclosed = False
    if reasoning:
        start, end = reasoning
        if fields(parse(f"{start} r1 {end} c1 ")) != ("r1", "c1") or fields(parse(f" r2 {end} c2")) != ("r2", "c2"):
            return None
        got = fields(parse(" u3 "))
        if got not in (("u3", ""), ("", "u3")):
            return None
        unclosed = got == ("u3", "")
    elif fields(parse(" c4 ")) != ("", "c4"):
        return None
    if tool_start:
        closed = f" r5 {reasoning[1]}" if reasoning else ""  # calls come after thinking
        m = parse(f'{closed} c5 {tool_start}\n{{"name": "probe_fn", "arguments": {{}}}}\n</tool_call>', with_tools=True)
        if m.content != "c5" or [c.name for c in m.tool_calls] != ["probe_fn"]:
            tool_start = None  # the parser's call layout is not the probed one: content with tools waits for the parse
    return MarkerRules(stops=stops, reasoning=reasoning, unclosed_is_reasoning=unclosed, tool_call_start=tool_start)


def _parser_markers(codec: Any, tok: Any) -> tuple[str, str] | None:
    """The reasoning parser's start / end strings (any token length), or None without a reasoning parser."""
    name = getattr(codec, "reasoning_parser_name", "")
    if not name:
        return None
    from vllm.reasoning import ReasoningParserManager

    try:
        rp = ReasoningParserManager.get_reasoning_parser(name)(tok)
        start, end = rp.reasoning_start_str, rp.reasoning_end_str
    except Exception:  # noqa: BLE001 - a parser without fixed markers (channels): the probes refuse it
        return None
    return (start, end) if start and end else None


def _tool_call_start(codec: Any, tok: Any) -> str | None:
    name = getattr(codec, "tool_parser_name", "")
    if not name:
        return None
    from vllm.tool_parsers import ToolParserManager

    try:
        start = getattr(ToolParserManager.get_tool_parser(name)(tok), "tool_call_start_token", None)
    except Exception:  # noqa: BLE001 - a parser that cannot be built for this tokenizer: no split
        return None
    return start if isinstance(start, str) and start else None


def build_codec(checkpoint_dir: str | Path, settings: ServeSettings) -> ServeCodec:
    """The server's codec for a checkpoint directory, chosen as training chooses it (`model.chat_codec`)."""
    name = resolve_codec_name(settings.chat_codec, str(checkpoint_dir))
    if name != "hf":
        defaults = ServeSettings()
        for flag, value, default in (("--tool-parser", settings.tool_parser, defaults.tool_parser),
                                     ("--reasoning-parser", settings.reasoning_parser, defaults.reasoning_parser)):
            if value != default:
                raise ServeError(f"{flag} {value!r} is read only by the hf chat codec, and this server uses the {name} codec "
                                 f"(--chat-codec {settings.chat_codec}, {checkpoint_dir}); pass --chat-codec hf or drop the flag")
    try:
        codec = make_codec(name, checkpoint_dir, tool_parser=settings.tool_parser, reasoning_parser=settings.reasoning_parser)
    except (CodecError, OSError, ValueError) as e:
        how = "follows the checkpoint" if settings.chat_codec == AUTO else "was asked for"
        raise ServeError(f"{checkpoint_dir}: the {name} chat codec ({how}) cannot be built: {e}") from None
    out = ServeCodec(codec)
    config_json = Path(checkpoint_dir, "config.json")
    model_type = json.loads(config_json.read_text()).get("model_type") if config_json.is_file() else None
    if out.is_project_format and settings.max_images > 0 and model_type == "hybrid_moe":  # the one vision tower here
        from model.configuration import HybridMoeConfig
        from model.vision import VisionSpec

        out.vision = VisionSpec.from_config(HybridMoeConfig.from_pretrained(str(checkpoint_dir)))
        out.max_images = settings.max_images
    return out
