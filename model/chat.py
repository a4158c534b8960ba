"""The jointrl chat format: typed messages -> prompt text, and generated text -> typed messages.

What it does
- Fixes the special tokens and their ids (the shipped tokenizer in `model/tokenizer/` is trained
  with exactly these, see `scripts/train_tokenizer.py`).
- `render` turns `jointrl.records.Message`s (+ optional OpenAI function schemas) into the prompt
  string. `CHAT_TEMPLATE` is the same format as a Jinja template (shipped in
  `tokenizer_config.json`), so `tokenizer.apply_chat_template` and vLLM produce the identical
  string; the tests check the two on many conversations.
- Helpers for token-in/token-out agent loops: `render_completion` (what the model generates for
  one assistant message), `render_turn_suffix` (what to append after a generated `<|im_end|>`).
  Every message renders independently of the ones after it, so
  `render(m[:k+1])` starts with `render(m[:k])` at every turn boundary k >= 1 (k = 0 too when the
  conversation has no system message or no tools).
- `parse_assistant` turns generated text back into a `Message` (reasoning, content, tool calls);
  malformed tool calls are listed in `errors` (and `call_errors`), never raised: tool-call JSON is
  decoded through `jointrl.safejson` under a size and nesting limit (`MAX_CALL_CHARS`,
  `MAX_CALL_DEPTH`), so over-deep nesting or a 19,000-digit number is an error line, not a
  `RecursionError` / `ValueError`. `parse_conversation` inverts `render` for whole conversations.

What it does not do
- Tokenise: callers encode the strings with the tokenizer (special-token strings inside message
  text are NOT escaped; text from tools that contains e.g. "<|im_end|>" becomes that token. The
  agent loop decides whether to sanitise tool output).
- Render tool-call ids or a tool message's `tool_call_id` / `name`: the model never sees ids.
  Parsing assigns deterministic ids `call_<turn>_<i>` (turn = 0-based index of the assistant
  message in the conversation, i = index among that message's well-formed calls); a tool message
  gets the id of the call it answers by position.
- Images: each image of a message is a single `<|image|>` placeholder placed before its text;
  expanding a placeholder into per-patch tokens is the model's processor's job.

Format (own design, in the family of ChatML / Qwen / Hermes tool calling):

    <|im_start|>system\n{system text}\n\n{TOOLS_HEADER}\n{tool json}...{TOOLS_FOOTER}<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}
        [\n if content]<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>[\n<tool_call>...]<|im_end|>\n
    <|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>\n

The generation prompt is `<|im_start|>assistant\n<think>`: the model always starts in its
thinking block (an empty block is how "no thinking" looks). It stops right after the special
token, without the newline, so that every boundary between prompt text and generated text sits
just after a special token: then encoding the pieces separately gives the same ids as encoding
the whole conversation (BPE pre-tokenisation never merges across a special token, but would merge
a prompt's trailing "\n" with a generated leading "\n"). Earlier turns keep their reasoning in
full: the seed articles require the complete history of thinking and tool calls in every request.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from jointrl import safejson
from jointrl.records import Message, ToolCall

# --------------------------------------------------------------------------- special tokens
# The position in this tuple IS the token id; the tokenizer trainer assigns them in this order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|image|>",
)
PAD_TOKEN, ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN = SPECIAL_TOKENS[0:4]
THINK_START_TOKEN, THINK_END_TOKEN, TOOL_CALL_START_TOKEN, TOOL_CALL_END_TOKEN = SPECIAL_TOKENS[4:8]
TOOL_RESPONSE_START_TOKEN, TOOL_RESPONSE_END_TOKEN, IMAGE_TOKEN = SPECIAL_TOKENS[8:11]

PAD_ID = 0
ENDOFTEXT_ID = 1  # document separator for pre-training-style text; not used inside chats
IM_START_ID = 2
IM_END_ID = 3  # end of every turn: the eos for chat generation
THINK_START_ID = 4
THINK_END_ID = 5
TOOL_CALL_START_ID = 6
TOOL_CALL_END_ID = 7
TOOL_RESPONSE_START_ID = 8
TOOL_RESPONSE_END_ID = 9
IMAGE_ID = 10
EOS_TOKEN = IM_END_TOKEN
EOS_ID = IM_END_ID
# Stop generation at the end of the assistant turn; <|endoftext|> too, in case a model trained on
# raw documents emits it.
STOP_TOKEN_IDS: tuple[int, ...] = (IM_END_ID, ENDOFTEXT_ID)
# Tokens a generation may legitimately contain and a decoder must keep (skip_special_tokens
# drops only the "special" ones: pad, endoftext, im_start, im_end, image).
NON_SKIPPED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS[4:10]
# The chat-structure tokens that text from a user, a tool or a web page must never turn into, or it
# could forge turns (`<|im_end|><|im_start|>assistant`). The thinking / tool-call markers are not
# here: text may legitimately quote them, and they only mean something inside an assistant turn.
STRUCTURE_TOKENS: tuple[str, ...] = (PAD_TOKEN, ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, IMAGE_TOKEN)


def defuse(text: str, specials: Sequence[str] = STRUCTURE_TOKENS) -> str:
    """Break up every special-token string in `text` (a zero-width space after its first two
    characters) so the tokenizer cannot read it as that token; text without one is returned as is."""
    for s in specials:
        if s in text:
            text = text.replace(s, s[:2] + "\u200b" + s[2:])
    return text

# What vLLM's `ReasoningConfig(reasoning_start_str=..., reasoning_end_str=...)` needs for
# `SamplingParams.thinking_token_budget`: each string must encode to exactly one token id.
REASONING_START_STR = THINK_START_TOKEN
REASONING_END_STR = THINK_END_TOKEN

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"

ASSISTANT_HEADER = f"{IM_START_TOKEN}assistant\n"
GENERATION_PROMPT = f"{ASSISTANT_HEADER}{THINK_START_TOKEN}"

# Fixed text of the tools section of the system prompt (own wording). The Jinja template below
# spells the same text; the tests compare the two renderers, so drift is caught.
TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more of the functions described below. Each function's signature is a "
    "JSON schema, one per line, inside <tools></tools>:\n"
    "<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "To call a function, write one JSON object per call between <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
    "Results come back in a tool turn between <tool_response></tool_response> tags."
)

# The Jinja twin of `render`. Written for transformers' chat-template environment (trim_blocks,
# lstrip_blocks, its `tojson` = json.dumps(ensure_ascii=False), `raise_exception`), which is also
# what vLLM uses. All literal text is emitted through expressions so whitespace control can not
# eat a newline. Accepts OpenAI-style dicts: content as a string or a list of parts
# ({"type": "text"} / {"type": "image" | "image_url" | "input_image"}), reasoning under
# `reasoning_content` or `reasoning`, tool-call arguments as a JSON string (rendered verbatim) or
# a mapping (rendered with tojson, which vLLM's server always does: it parses arguments first).
CHAT_TEMPLATE = r"""{#- jointrl chat format. Python twin: model/chat.py (render); keep both in step. -#}
{%- macro content_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url', 'input_image'] -%}
                {{- '<|image|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(first=0) -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {%- set system_text = content_text(messages[0].content) -%}
        {%- if system_text -%}
            {{- system_text + '\n\n' -}}
        {%- endif -%}
        {%- set ns.first = 1 -%}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more of the functions described below. Each function\'s signature is a JSON schema, one per line, inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, write one JSON object per call between <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\nResults come back in a tool turn between <tool_response></tool_response> tags.' -}}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.index0 >= ns.first -%}
        {%- if message.role == 'system' or message.role == 'user' -%}
            {{- '<|im_start|>' + message.role + '\n' + content_text(message.content) + '<|im_end|>\n' -}}
        {%- elif message.role == 'tool' -%}
            {{- '<|im_start|>tool\n<tool_response>\n' + content_text(message.content) + '\n</tool_response><|im_end|>\n' -}}
        {%- elif message.role == 'assistant' -%}
            {%- if message.reasoning_content is defined and message.reasoning_content is not none -%}
                {%- set reasoning = message.reasoning_content -%}
            {%- elif message.reasoning is defined and message.reasoning is not none -%}
                {%- set reasoning = message.reasoning -%}
            {%- else -%}
                {%- set reasoning = '' -%}
            {%- endif -%}
            {%- set text = content_text(message.content) -%}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + text -}}
            {%- if message.tool_calls -%}
                {%- for call in message.tool_calls -%}
                    {%- if call.function is defined -%}
                        {%- set fn = call.function -%}
                    {%- else -%}
                        {%- set fn = call -%}
                    {%- endif -%}
                    {%- if text or not loop.first -%}
                        {{- '\n' -}}
                    {%- endif -%}
                    {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
                    {%- if fn.arguments is not defined or fn.arguments is none -%}
                        {{- '{}' -}}
                    {%- elif fn.arguments is string -%}
                        {{- fn.arguments -}}
                    {%- else -%}
                        {{- fn.arguments | tojson -}}
                    {%- endif -%}
                    {{- '}\n</tool_call>' -}}
                {%- endfor -%}
            {%- endif -%}
            {{- '<|im_end|>\n' -}}
        {%- else -%}
            {{- raise_exception('jointrl chat template: unknown message role ' + (message.role | string)) -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n<think>' -}}
{%- endif -%}
"""


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class ParsedAssistant:
    """The result of parsing one generated assistant turn.

    message: role "assistant" with reasoning (None when the thinking block is empty), content and
        the well-formed tool calls (ids `call_<turn>_<i>`).
    errors: one human-readable line per problem (malformed tool call, unclosed thinking, stray
        text); empty when the text is in the canonical format.
    ended: True when the text contained `<|im_end|>` (False e.g. when generation hit a length cap
        or the engine stripped the stop token from its text).
    call_errors: the lines of `errors` that are about a `<tool_call>` block which did not become a
        call (bad JSON, no name, no closing tag, over the parser's limits): one per dropped call,
        in text order. An environment answers these as malformed calls (`ToolEnv.step(parse_errors=)`).
    """

    message: Message
    errors: tuple[str, ...] = ()
    ended: bool = False
    call_errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParsedConversation:
    """The result of `parse_conversation`: messages, tools (None when no tools section) and errors."""

    messages: tuple[Message, ...]
    tools: tuple[Any, ...] | None
    add_generation_prompt: bool
    errors: tuple[str, ...] = ()


# --------------------------------------------------------------------------- rendering
def tool_call_id(turn: int, index: int) -> str:
    """The deterministic id parsing gives to call `index` of assistant message number `turn`."""
    return f"call_{turn}_{index}"


def _content_text(message: Message, where: str) -> str:
    if not isinstance(message.content, str):
        raise TypeError(f"{where}: content must be a str, got {type(message.content).__name__}")
    return IMAGE_TOKEN * len(message.images) + message.content


def _check_message(message: Any, where: str) -> Message:
    if not isinstance(message, Message):
        raise TypeError(f"{where}: expected jointrl.records.Message, got {type(message).__name__}")
    if message.role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"{where}: unknown role {message.role!r}; allowed: system, user, assistant, tool")
    if message.role != "assistant":
        if message.tool_calls:
            raise ValueError(f"{where}: only assistant messages may carry tool_calls (role {message.role!r})")
        if message.reasoning is not None:
            raise ValueError(f"{where}: only assistant messages may carry reasoning (role {message.role!r})")
    elif message.images:
        raise ValueError(f"{where}: assistant messages can not carry images")
    return message


def _render_tool_call(call: ToolCall, where: str) -> str:
    if not isinstance(call, ToolCall):
        raise TypeError(f"{where}: expected jointrl.records.ToolCall, got {type(call).__name__}")
    if not isinstance(call.name, str) or not call.name:
        raise ValueError(f"{where}: tool call name must be a non-empty string, got {call.name!r}")
    try:
        args = json.loads(call.arguments)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} ({call.name!r}): arguments are not valid JSON text: {call.arguments!r} ({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where} ({call.name!r}): arguments must be a JSON object, got {call.arguments!r}")
    # Arguments go in verbatim (the exact text the model wrote), so re-rendering a parsed turn
    # reproduces what was generated; the name is JSON-quoted like Jinja's `tojson`.
    name = json.dumps(call.name, ensure_ascii=False)
    return f'{TOOL_CALL_START_TOKEN}\n{{"name": {name}, "arguments": {call.arguments}}}\n{TOOL_CALL_END_TOKEN}'


def render_message(message: Message, *, where: str = "message") -> str:
    """One message as its own turn, from `<|im_start|>` to the `\\n` after `<|im_end|>`.

    A leading system message with tools is rendered by `render` instead (tools join it).
    """
    m = _check_message(message, where)
    text = _content_text(m, where)
    if m.role in ("system", "user"):
        return f"{IM_START_TOKEN}{m.role}\n{text}{IM_END_TOKEN}\n"
    if m.role == "tool":
        return f"{IM_START_TOKEN}tool\n{TOOL_RESPONSE_START_TOKEN}\n{text}\n{TOOL_RESPONSE_END_TOKEN}{IM_END_TOKEN}\n"
    reasoning = m.reasoning or ""
    out = [f"{GENERATION_PROMPT}\n{reasoning}\n{THINK_END_TOKEN}\n\n{text}"]
    for i, call in enumerate(m.tool_calls):
        if text or i > 0:
            out.append("\n")
        out.append(_render_tool_call(call, f"{where}.tool_calls[{i}]"))
    out.append(f"{IM_END_TOKEN}\n")
    return "".join(out)


def _tool_name(tool: Any) -> str | None:
    if not isinstance(tool, Mapping):
        return None
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) and name else None


def render_tools_system(tools: Sequence[Mapping[str, Any]], system_text: str = "") -> str:
    """The system turn that lists `tools` (OpenAI function schemas), after optional system text."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools: expected a sequence of OpenAI function schemas, got {type(tools).__name__}")
    lines = []
    for i, tool in enumerate(tools):
        if _tool_name(tool) is None:
            raise ValueError(
                f"tools[{i}]: expected an OpenAI function schema with a non-empty name "
                f"({{'type': 'function', 'function': {{'name': ...}}}} or {{'name': ...}}), got {tool!r}"
            )
        try:
            lines.append("\n" + json.dumps(tool, ensure_ascii=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"tools[{i}]: not JSON-serialisable ({e})") from None
    head = f"{system_text}\n\n" if system_text else ""
    return f"{IM_START_TOKEN}system\n{head}{TOOLS_HEADER}{''.join(lines)}{TOOLS_FOOTER}{IM_END_TOKEN}\n"


def render(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The prompt text of a conversation; identical to `apply_chat_template(..., tokenize=False)`.

    tools: OpenAI function schemas, listed in the (first) system turn; a system turn is created
        when the conversation does not start with one.
    add_generation_prompt: append `GENERATION_PROMPT` (assistant header + opening `<think>`).
    """
    if isinstance(messages, (str, bytes, Message)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages: expected a sequence of jointrl.records.Message, got {type(messages).__name__}")
    parts: list[str] = []
    first = 0
    if tools:
        system_text = ""
        if messages and isinstance(messages[0], Message) and messages[0].role == "system":
            system_text = _content_text(_check_message(messages[0], "messages[0]"), "messages[0]")
            first = 1
        parts.append(render_tools_system(tools, system_text))
    for i in range(first, len(messages)):
        parts.append(render_message(messages[i], where=f"messages[{i}]"))
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def render_completion(message: Message) -> str:
    """What the model generates for `message` after `GENERATION_PROMPT`, ending with `<|im_end|>`.

    render(history, add_generation_prompt=True) + render_completion(m)
        == render(history + [m]) minus its final "\\n".
    """
    if not isinstance(message, Message) or message.role != "assistant":
        raise ValueError(f"render_completion: expected an assistant Message, got {message!r}")
    text = render_message(message)
    return text[len(GENERATION_PROMPT) : -1]


def render_turn_suffix(new_messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """Text to append after a generated turn that ended with `<|im_end|>`.

    For an agent loop holding token ids: after the model's `<|im_end|>`, encode and append
    this string (the "\\n" closing the turn, the new tool/user messages, the next assistant
    header). Holds: render(m[:k], True) + render_completion(m[k]) + render_turn_suffix(m[k+1:n])
    == render(m[:n], True) for an assistant message m[k] (k >= 1 when tools join a system m[0]).
    Because every piece starts right after a special token, encoding the pieces separately gives
    the same ids as encoding the whole string.
    """
    if isinstance(new_messages, Message) or not isinstance(new_messages, Sequence):
        raise TypeError(f"new_messages: expected a sequence of Message, got {type(new_messages).__name__}")
    body = "".join(render_message(m, where=f"new_messages[{i}]") for i, m in enumerate(new_messages))
    return "\n" + body + (GENERATION_PROMPT if add_generation_prompt else "")


def to_template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """OpenAI-style dicts for `tokenizer.apply_chat_template` / vLLM's chat API.

    Like `Message.to_openai`, but images become `{"type": "image"}` content parts (placed before
    the text, as `render` places the placeholders), so the Jinja template sees them.
    """
    out = []
    for i, m in enumerate(messages):
        _check_message(m, f"messages[{i}]")
        d = m.to_openai()
        if m.images:
            parts: list[dict[str, Any]] = [{"type": "image"} for _ in m.images]
            if m.content:
                parts.append({"type": "text", "text": m.content})
            d["content"] = parts
        out.append(d)
    return out


# --------------------------------------------------------------------------- parsing
_NAME_RE = re.compile(r'\{\s*"name"\s*:\s*')
_ARGS_RE = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_CLOSE_RE = re.compile(r"\s*\}\s*\Z")
# Parser limits (docs/chat_format.md, "Parsing limits"). A `<tool_call>` body longer than
# MAX_CALL_CHARS is reported, not decoded; JSON nested deeper than MAX_CALL_DEPTH (the call object is
# level 1, its arguments level 2) is reported before decoding, so the decoder never recurses deeply.
# Both sit far above what an environment accepts (envs.tools: max_arg_chars, MAX_ARG_DEPTH), so the
# environment, not the codec, is what tells the model its arguments are too big.
MAX_CALL_CHARS = 1_000_000
MAX_CALL_DEPTH = 65


def _parse_call(inner: str, idx: int) -> tuple[str, str] | str:
    """(name, raw arguments text) of one `<tool_call>` body, or an error line. Never raises."""
    inner = inner.strip()
    if len(inner) > MAX_CALL_CHARS:
        return f"tool call {idx}: {len(inner)} characters; the parser's limit is {MAX_CALL_CHARS}: {inner[:200]!r}"
    # Fast path for the canonical layout {"name": ..., "arguments": {...}}: keep the exact
    # arguments text the model wrote (history must be reproduced verbatim).
    m = _NAME_RE.match(inner)
    if m:
        try:
            # Decoding starts inside the call object, so the values there may nest one level less.
            name, k = safejson.raw_decode(inner, m.end(), max_depth=MAX_CALL_DEPTH - 1)
            m2 = _ARGS_RE.match(inner, k)
            if m2:
                args, k2 = safejson.raw_decode(inner, m2.end(), max_depth=MAX_CALL_DEPTH - 1)
                if _CLOSE_RE.match(inner, k2) and isinstance(name, str) and name and isinstance(args, dict):
                    return name, inner[m2.end() : k2]
        except ValueError:
            pass  # the general path below reports the JSON error
    try:
        obj = safejson.loads(inner, max_depth=MAX_CALL_DEPTH)
    except ValueError as e:
        return f"tool call {idx}: invalid JSON ({e}): {inner[:200]!r}"
    if not isinstance(obj, dict):
        return f"tool call {idx}: expected a JSON object, got {type(obj).__name__}: {inner[:200]!r}"
    if "name" not in obj:
        return f"tool call {idx}: missing 'name': {inner[:200]!r}"
    name = obj["name"]
    if not isinstance(name, str) or not name:
        return f"tool call {idx}: 'name' must be a non-empty string, got {repr(name)[:100]}"
    shown = repr(name[:100])
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode; accept a string holding an object
        try:
            args = safejson.loads(args, max_depth=MAX_CALL_DEPTH - 1)
        except ValueError as e:
            return f"tool call {idx} ({shown}): 'arguments' is a string that is not JSON ({e}): {obj['arguments'][:200]!r}"
    if not isinstance(args, dict):
        return f"tool call {idx} ({shown}): 'arguments' must be a JSON object, got {type(args).__name__}"
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return f"tool call {idx} ({shown}): unexpected keys {[k[:100] for k in extra[:10]]}"
    try:
        return name, json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError) as e:  # decoded under the depth limit, so not expected; kept as a guard
        return f"tool call {idx} ({shown}): arguments cannot be re-encoded ({type(e).__name__})"


def parse_assistant(text: str, turn: int = 0) -> ParsedAssistant:
    """Parse one generated assistant turn into a Message; never raises on malformed text.

    text: what the model generated after `GENERATION_PROMPT` (decoded with special tokens kept),
        optionally starting with the header and `<think>` and ending with or without `<|im_end|>`.
    turn: 0-based index of this assistant message in the conversation (for tool-call ids).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_assistant: text must be a str, got {type(text).__name__}")
    errors: list[str] = []
    call_errors: list[str] = []
    body = text
    if body.startswith(ASSISTANT_HEADER):
        body = body[len(ASSISTANT_HEADER) :]
    if body.startswith(THINK_START_TOKEN):
        body = body[len(THINK_START_TOKEN) :]
    if body.startswith("\n"):  # the rendered newline after <think>
        body = body[1:]
    end = body.find(IM_END_TOKEN)
    ended = end >= 0
    if ended:
        tail = body[end + len(IM_END_TOKEN) :]
        body = body[:end]
        if tail.strip():
            errors.append(f"text after {IM_END_TOKEN} ignored: {tail[:200]!r}")

    close = body.find(THINK_END_TOKEN)
    if close < 0:
        # Thinking never closed (length cap, or the model skipped </think>): all of it is
        # reasoning; tool calls inside it are not executed.
        if body:
            errors.append(f"reasoning not closed by {THINK_END_TOKEN}; no content or tool calls parsed")
        reasoning = body[:-1] if body.endswith("\n") else body
        msg = Message(role="assistant", content="", reasoning=reasoning or None)
        return ParsedAssistant(message=msg, errors=tuple(errors), ended=ended)

    reasoning = body[:close]
    if reasoning.endswith("\n"):
        reasoning = reasoning[:-1]
    rest = body[close + len(THINK_END_TOKEN) :]
    if rest.startswith("\n\n"):
        rest = rest[2:]
    elif rest.startswith("\n"):
        rest = rest[1:]

    first = rest.find(TOOL_CALL_START_TOKEN)
    calls: list[ToolCall] = []
    if first < 0:
        content = rest
    else:
        content = rest[:first]
        if content.endswith("\n"):
            content = content[:-1]
        pos, idx = first, 0
        while True:
            start = rest.find(TOOL_CALL_START_TOKEN, pos)
            if start < 0:
                trailing = rest[pos:]
                if trailing.strip():
                    errors.append(f"text after the last tool call ignored: {trailing[:200]!r}")
                break
            between = rest[pos:start]
            if idx > 0 and between.strip():
                errors.append(f"text between tool calls ignored: {between[:200]!r}")
            stop = rest.find(TOOL_CALL_END_TOKEN, start)
            if stop < 0:
                call_errors.append(f"tool call {idx}: no closing {TOOL_CALL_END_TOKEN}: {rest[start:start + 200]!r}")
                errors.append(call_errors[-1])
                break
            inner = rest[start + len(TOOL_CALL_START_TOKEN) : stop]
            if TOOL_CALL_START_TOKEN in inner:
                call_errors.append(f"tool call {idx}: nested {TOOL_CALL_START_TOKEN}: {inner[:200]!r}")
                errors.append(call_errors[-1])
            else:
                got = _parse_call(inner, idx)
                if isinstance(got, str):
                    call_errors.append(got)
                    errors.append(got)
                else:
                    calls.append(ToolCall(id=tool_call_id(turn, len(calls)), name=got[0], arguments=got[1]))
            pos, idx = stop + len(TOOL_CALL_END_TOKEN), idx + 1
    msg = Message(role="assistant", content=content, tool_calls=tuple(calls), reasoning=reasoning or None)
    return ParsedAssistant(message=msg, errors=tuple(errors), ended=ended, call_errors=tuple(call_errors))


def parse_conversation(text: str) -> ParsedConversation:
    """Invert `render`: split the text into turns and parse each; problems go to `errors`.

    Round trip: parse_conversation(render(m, tools, g)) gives back m, tools and g for messages in
    the canonical domain (ids `call_<turn>_<i>`, no `name` on tool messages, no images, no
    special-token strings inside text, non-empty reasoning or None, a system message with
    non-empty text when tools are given).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_conversation: text must be a str, got {type(text).__name__}")
    messages: list[Message] = []
    errors: list[str] = []
    tools: tuple[Any, ...] | None = None
    gen_prompt = False
    turn = -1  # index of the latest assistant message
    answered = 0  # tool messages since that assistant message
    last_calls: tuple[ToolCall, ...] = ()
    pos = 0
    while pos < len(text):
        if not text.startswith(IM_START_TOKEN, pos):
            errors.append(f"at char {pos}: expected {IM_START_TOKEN}, found {text[pos:pos + 40]!r}; rest ignored")
            break
        nl = text.find("\n", pos)
        if nl < 0:
            errors.append(f"at char {pos}: turn header without newline; rest ignored")
            break
        role = text[pos + len(IM_START_TOKEN) : nl]
        end = text.find(IM_END_TOKEN, nl)
        if role == "assistant" and end < 0:
            rest = text[nl + 1 :]
            if rest == THINK_START_TOKEN:
                gen_prompt = True
            else:  # an unfinished generation: parse what is there
                turn += 1
                parsed = parse_assistant(rest, turn)
                messages.append(parsed.message)
                errors.extend(f"assistant turn {turn}: {e}" for e in parsed.errors)
            break
        if end < 0:
            errors.append(f"at char {pos}: {role!r} turn without {IM_END_TOKEN}; rest ignored")
            break
        body = text[nl + 1 : end]
        pos = end + len(IM_END_TOKEN)
        if text.startswith("\n", pos):
            pos += 1
        else:
            errors.append(f"at char {pos}: expected a newline after {IM_END_TOKEN}")
        if role == "system" and not messages and tools is None and body.endswith(TOOLS_FOOTER):
            head, sep, listed = body[: -len(TOOLS_FOOTER)].rpartition(TOOLS_HEADER)
            if sep and (head == "" or head.endswith("\n\n")):
                parsed_tools = []
                for line in listed.split("\n")[1:]:
                    try:
                        parsed_tools.append(json.loads(line))
                    except ValueError as e:
                        errors.append(f"tools: invalid JSON line ({e}): {line[:200]!r}")
                tools = tuple(parsed_tools)
                if head:
                    messages.append(Message(role="system", content=head[:-2]))
                continue
        if role in ("system", "user"):
            messages.append(Message(role=role, content=body))
        elif role == "tool":
            prefix, suffix = f"{TOOL_RESPONSE_START_TOKEN}\n", f"\n{TOOL_RESPONSE_END_TOKEN}"
            if body.startswith(prefix) and body.endswith(suffix) and len(body) >= len(prefix) + len(suffix):
                body = body[len(prefix) : -len(suffix)]
            else:
                errors.append(f"tool turn at char {nl}: not wrapped in {TOOL_RESPONSE_START_TOKEN}...{TOOL_RESPONSE_END_TOKEN}")
            call_id = last_calls[answered].id if answered < len(last_calls) else tool_call_id(max(turn, 0), answered)
            messages.append(Message(role="tool", content=body, tool_call_id=call_id))
            answered += 1
        elif role == "assistant":
            turn += 1
            parsed = parse_assistant(body, turn)
            messages.append(parsed.message)
            errors.extend(f"assistant turn {turn}: {e}" for e in parsed.errors)
            last_calls, answered = parsed.message.tool_calls, 0
        else:
            errors.append(f"unknown role {role!r} at char {nl}; turn skipped")
    return ParsedConversation(messages=tuple(messages), tools=tools, add_generation_prompt=gen_prompt, errors=tuple(errors))


# --------------------------------------------------------------------------- tokenizer access
def load_tokenizer(path: str | Path = TOKENIZER_DIR):
    """The shipped tokenizer via `transformers.AutoTokenizer`, checked against this module's ids."""
    from transformers import AutoTokenizer  # lazy: importing transformers costs seconds

    tok = AutoTokenizer.from_pretrained(str(path))
    for want_id, token in enumerate(SPECIAL_TOKENS):
        got = tok.convert_tokens_to_ids(token)
        if got != want_id:
            raise ValueError(f"tokenizer at {path}: {token!r} has id {got}, the chat format needs {want_id}")
    return tok
