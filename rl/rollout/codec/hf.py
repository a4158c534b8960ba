"""The `hf` codec: a checkpoint's own chat format, parsed with vLLM's registered parsers.

Rendering: the checkpoint's `chat_template` through `tokenizer.apply_chat_template` (`JinjaRenderer`);
for harmony checkpoints (gpt-oss: `model.tool_parser: openai`) the `openai_harmony` renderer, which
the gpt-oss template re-implements (`HarmonyRenderer`, full history: analysis messages are not dropped).
Parsing: vLLM's unified parser (`vllm.parser.ParserManager.get_parser`), i.e. the tool parser named by
`model.tool_parser` (`hermes`, `qwen3_coder`, `openai`, `deepseek_v3`, `glm45`, ...) composed with the
reasoning parser named by `model.reasoning_parser`, exactly what `vllm serve` would run.

Environment turns are the template's delta: with history H ending in the assistant message just
parsed, A = render(H) cut right after its last end-of-turn token (rendered with the generation prompt,
which is cut off again: vLLM's chatml closes the last message only then), B = render(H + new,
generation prompt). A prefix-stable template has B = A + delta; the delta starts right after a special token, so
it cannot merge with what came before. A template that is not prefix-stable (it drops earlier
reasoning, re-renders tool calls, injects empty think blocks) is detected at the first environment
turn and logged once; the delta is then B after its n-th end-of-turn token (n = the count in A), and
the episode keeps the tokens the model actually saw, so full history is retained. After two turns on
which a short context (the conversation's head + the last assistant turn) gave the same delta as the
whole history, deltas are rendered from it: re-rendering everything costs O(episode) per turn.

Templates without a tool section (SmolLM2's): tools are presented Hermes-style, the schemas in the
system message (`HERMES_TOOLS_*`), earlier calls as `<tool_call>` blocks in the assistant content and
results wrapped in `<tool_response>`, and parsed by the `hermes` tool parser (docs/chat_format.md).

What it does not do: write any parser or template of its own for the formats vLLM parses.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol, Sequence

from jointrl.records import Message, ToolCall
from rl.log import get_logger
from rl.rollout.codec.base import ChatCodec, CodecError, ParsedTurn, register_codec

log = get_logger("codec")

HARMONY_TOOL_PARSER = "openai"  # vLLM's name for the harmony (gpt-oss) tool parser

# Hermes-style tool presentation for templates without a tool section (the Hermes 2 Pro / Qwen2.5
# function-calling prompt, own wording); the `hermes` tool parser reads the calls it asks for.
HERMES_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query. "
                       "The function signatures are inside <tools></tools>:\n<tools>")
HERMES_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a JSON object with the function name and "
                       "arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
                       '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tool_call_id(turn: int, index: int) -> str:
    """Same ids as model/chat.py's parser: `call_<turn>_<i>`."""
    return f"call_{turn}_{index}"


def _args_obj(arguments: str) -> Any:
    """Tool-call arguments as the mapping templates expect (vLLM's server json-decodes them too)."""
    try:
        v = json.loads(arguments)
    except ValueError:
        return arguments
    return v if isinstance(v, dict) else arguments


class Renderer(Protocol):
    """Messages -> token ids, the checkpoint's way."""

    end_of_turn_ids: frozenset[int]  # ids that close a rendered message

    def render_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool) -> list[int]: ...


class JinjaRenderer:
    """`tokenizer.apply_chat_template`, plus Hermes-style tools where the template has no tool section."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        self.tok = tokenizer
        self.template = template
        self.native_tools = "tools" in template
        self.native_reasoning = "reasoning" in template
        self.end_of_turn_ids = frozenset({self._probe_end_id()})

    def _probe_end_id(self) -> int:
        """The token the template writes right after an assistant message's text."""
        probe = "zq7 probe"
        text = self._render_text([Message(role="user", content="u"), Message(role="assistant", content=probe)], None, True)
        at = text.rfind(probe)
        if at < 0:
            raise CodecError("chat template does not render assistant content; cannot find its end-of-turn token")
        rest = text[at + len(probe):]
        specials = sorted((t for t in self.tok.get_added_vocab() if t and rest.startswith(t)), key=len, reverse=True)
        if not specials:
            raise CodecError(f"chat template: no special token closes an assistant turn (it continues {rest[:40]!r})")
        return int(self.tok.convert_tokens_to_ids(specials[0]))

    def _to_dicts(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.role == "assistant":
                if m.reasoning is not None:
                    d["reasoning_content"] = m.reasoning
                if m.tool_calls and self.native_tools:
                    d["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": _args_obj(c.arguments)}} for c in m.tool_calls]
                elif m.tool_calls:
                    blocks = "\n".join('<tool_call>\n{"name": %s, "arguments": %s}\n</tool_call>' % (json.dumps(c.name), c.arguments)
                                       for c in m.tool_calls)
                    d["content"] = f"{m.content}\n{blocks}" if m.content else blocks
            elif m.role == "tool":
                if self.native_tools:
                    d["tool_call_id"] = m.tool_call_id
                    if m.name:
                        d["name"] = m.name
                else:
                    d["content"] = f"<tool_response>\n{m.content}\n</tool_response>"
            out.append(d)
        if tools and not self.native_tools:
            schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            text = HERMES_TOOLS_HEADER + schemas + HERMES_TOOLS_FOOTER
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def _render_text(self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(self._to_dicts(messages, tools), tools=list(tools) if tools and self.native_tools else None,
                                            add_generation_prompt=add_generation_prompt, tokenize=False)

    def render_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool) -> list[int]:
        return list(self.tok.encode(self._render_text(messages, tools, add_generation_prompt), add_special_tokens=False))


class HarmonyRenderer:
    """The harmony format through `openai_harmony` (full history: `auto_drop_analysis=False`).

    Reasoning goes to the `analysis` channel, tool calls to `commentary` addressed to
    `functions.<name>` (JSON), content to `final`; tools become a developer message's function tools.
    """

    def __init__(self, auto_drop_analysis: bool = False) -> None:
        import openai_harmony as h

        self.h = h
        self.enc = h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
        self.config = h.RenderConversationConfig(auto_drop_analysis=auto_drop_analysis)
        ids = {t: self.enc.encode(t, allowed_special="all")[0] for t in ("<|end|>", "<|call|>", "<|return|>")}
        self.end_id = ids["<|end|>"]
        self.end_of_turn_ids = frozenset(ids.values())
        self.stop_ids = tuple(self.enc.stop_tokens_for_assistant_actions())

    def _conversation(self, messages: Sequence[Message], tools: Sequence[dict] | None):
        h = self.h
        out = [h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new())]
        dev_text = "\n\n".join(m.content for m in messages if m.role == "system")
        if dev_text or tools:
            dev = h.DeveloperContent.new().with_instructions(dev_text) if dev_text else h.DeveloperContent.new()
            if tools:
                dev = dev.with_function_tools([h.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                                                     parameters=t["function"].get("parameters"))
                                               for t in tools])
            out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
        names: dict[str, str] = {}
        for m in messages:
            if m.role == "user":
                out.append(h.Message.from_role_and_content(h.Role.USER, m.content))
            elif m.role == "assistant":
                if m.reasoning:
                    out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m.reasoning).with_channel("analysis"))
                if m.content:
                    out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m.content).with_channel("final"))
                for c in m.tool_calls:
                    names[c.id] = c.name
                    out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, c.arguments).with_channel("commentary")
                               .with_recipient(f"functions.{c.name}").with_content_type("<|constrain|>json"))
            elif m.role == "tool":
                name = m.name or names.get(m.tool_call_id or "", "tool")
                out.append(h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, f"functions.{name}"), m.content)
                           .with_channel("commentary").with_recipient("assistant"))
        return h.Conversation.from_messages(out)

    def render_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool) -> list[int]:
        conv = self._conversation(messages, tools)
        if add_generation_prompt:
            return list(self.enc.render_conversation_for_completion(conv, self.h.Role.ASSISTANT, self.config))
        return list(self.enc.render_conversation(conv, self.config))


def _eos_ids(checkpoint_dir: Path | None, tok: Any) -> list[int]:
    ids: list[int] = []
    gc = checkpoint_dir / "generation_config.json" if checkpoint_dir else None
    if gc is not None and gc.is_file():
        e = json.loads(gc.read_text()).get("eos_token_id")
        ids += [e] if isinstance(e, int) else list(e or [])
    if getattr(tok, "eos_token_id", None) is not None:
        ids.append(int(tok.eos_token_id))
    return ids


class HfCodec(ChatCodec):
    """A checkpoint's own template (or harmony) + vLLM's tool / reasoning parsers."""

    name = "hf"
    SHORT_CONTEXT_CHECKS = 2

    def __init__(self, tokenizer: Any, renderer: Renderer, *, tool_parser: str, reasoning_parser: str = "",
                 eos_ids: Sequence[int] = (), end_token_id: int | None = None) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser.parser_manager import ParserManager

        self.tokenizer = tokenizer
        self.renderer = renderer
        self.tool_parser_name = tool_parser
        self.reasoning_parser_name = reasoning_parser
        harmony = tool_parser == HARMONY_TOOL_PARSER
        self._parser_cls = ParserManager.get_parser(tool_parser_name=tool_parser or None,
                                                    reasoning_parser_name=reasoning_parser or None,
                                                    enable_auto_tools=True, is_harmony=harmony)
        self._request_cls = ChatCompletionRequest
        self.end_token_id = int(end_token_id if end_token_id is not None else min(renderer.end_of_turn_ids))
        self.stop_token_ids = tuple(dict.fromkeys([self.end_token_id, *(int(i) for i in eos_ids)]))
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else self.end_token_id)
        self.reasoning_markers = self._markers()
        specials = getattr(tokenizer, "all_special_tokens", None) or []
        self.special_strings = tuple(t for t in specials if t)
        self.prefix_stable: bool | None = None  # None until the first environment turn is rendered
        # Deltas come from a short context (the conversation's head + the last assistant turn) once it has
        # given the same ids as the whole history on SHORT_CONTEXT_CHECKS turns; a mismatch ends that for good.
        self._short_checks_left = self.SHORT_CONTEXT_CHECKS
        self._short_ok = True
        # vLLM's hermes parser logs a traceback for every malformed call; the codec reports those as
        # parse errors (the environment answers them), so one line per call is enough.
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)

    def _markers(self) -> tuple[str, str] | None:
        """The reasoning parser's start / end strings when each is one token (vLLM's thinking budgets need that)."""
        if not self.reasoning_parser_name or self._parser_cls is None or self._parser_cls.reasoning_parser_cls is None:
            return None
        try:
            rp = self._parser_cls.reasoning_parser_cls(self.tokenizer)
            start, end = rp.reasoning_start_str, rp.reasoning_end_str
        except Exception:  # noqa: BLE001 - a parser without fixed markers (harmony channels): no budgets
            return None
        if not start or not end:
            return None
        one = all(len(self.tokenizer.encode(s, add_special_tokens=False)) == 1 for s in (start, end))
        return (start, end) if one else None

    # ------------------------------------------------------------------ rendering
    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[int]:
        return self.renderer.render_ids(list(messages), tools, True)

    def _cut_after_last_end(self, ids: list[int]) -> list[int]:
        ends = self.renderer.end_of_turn_ids
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] in ends:
                return ids[: i + 1]
        raise CodecError("rendered history has no end-of-turn token")

    def _closed(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[int]:
        """`messages` rendered up to the end-of-turn token of the last one. Rendered with the generation
        prompt and cut, because some templates (vLLM's chatml) close the last message only then."""
        return self._cut_after_last_end(self.renderer.render_ids(list(messages), tools, True))

    def turn_ids(self, history: Sequence[Message], new_messages: Sequence[Message], tools: Sequence[dict] | None,
                 seen: Sequence[int] | None = None) -> list[int]:
        short = self._short_context(history)
        trusted = self._short_ok and self._short_checks_left == 0
        if short is not None and trusted:
            return self._delta(short, new_messages, tools, None)
        delta = self._delta(history, new_messages, tools, seen)
        if short is not None and self._short_ok:
            # Rendering the whole history costs O(episode) per turn (~50 ms at 12k tokens, docs/chat_format.md);
            # the new messages' rendering is local in the templates seen so far, which these checks confirm.
            if self._delta(short, new_messages, tools, None) == delta:
                self._short_checks_left -= 1
            else:
                self._short_ok = False
                log.info("chat template renders a new turn depending on more than the last assistant turn; "
                         "deltas are rendered from the whole history")
        return delta

    def _short_context(self, history: Sequence[Message]) -> list[Message] | None:
        """The leading system / first user messages and the last (assistant) message; None when that is all of it."""
        head = next((i + 1 for i, m in enumerate(history) if m.role == "user"), 0)
        if len(history) - 1 <= head:
            return None
        return list(history[:head]) + [history[-1]]

    def _delta(self, history: Sequence[Message], new_messages: Sequence[Message], tools: Sequence[dict] | None,
               seen: Sequence[int] | None) -> list[int]:
        """The template's ids for `new_messages` + the generation prompt after `history`; with `seen` (the
        episode's tokens) it also checks prefix stability, logged once."""
        before = self._closed(history, tools)
        after = self.renderer.render_ids(list(history) + list(new_messages), tools, True)
        if after[: len(before)] == before:
            delta = after[len(before):]
            drift = None
        else:  # the new messages change how earlier turns render (Qwen3 drops reasoning before a new user turn)
            delta = after[self._after_ends(after, self._count_ends(before)):]
            drift = ("rendering the next turn changes earlier turns", before, after)
        if seen is None:
            return delta
        if drift is None and list(seen) != before:
            # The template renders the history differently from the tokens the model saw (dropped reasoning,
            # re-rendered tool calls, a think block injected into the generation prompt).
            drift = ("the re-rendered history differs from the tokens the model saw", list(seen), before)
        if drift is None:
            if self.prefix_stable is None:
                self.prefix_stable = True
        else:
            if self.prefix_stable is not False:
                what, a, b = drift
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                log.warning("chat template is not prefix-stable: %s (first difference at token %d of %d). Episodes keep "
                            "the tokens the model actually saw (full history); each environment turn appends only the "
                            "template's rendering of the new messages (docs/chat_format.md)", what, at, len(a))
            self.prefix_stable = False
        return delta

    def _count_ends(self, ids: Sequence[int]) -> int:
        return sum(1 for t in ids if t in self.renderer.end_of_turn_ids)

    def _after_ends(self, ids: Sequence[int], n: int) -> int:
        """The position right after the n-th end-of-turn token of `ids` (0 for n = 0)."""
        if n == 0:
            return 0
        seen = 0
        for i, t in enumerate(ids):
            if t in self.renderer.end_of_turn_ids:
                seen += 1
                if seen == n:
                    return i + 1
        raise CodecError(f"chat template: the next turn renders {seen} end-of-turn tokens, fewer than the {n} of the "
                         "history; cannot locate the new messages")

    def completion_ids(self, history: Sequence[Message], message: Message, tools: Sequence[dict] | None) -> list[int]:
        prompt = self.renderer.render_ids(list(history), tools, True)
        full = self._closed(list(history) + [message], tools)
        if full[: len(prompt)] == prompt:
            return full[len(prompt):]
        # Not prefix-stable (the message makes earlier turns re-render, as harmony drops earlier analysis
        # once a final answer follows): render the message after a neutral one-line user turn instead.
        neutral = [Message(role="user", content=".")]
        prompt = self.renderer.render_ids(neutral, tools, True)
        full = self._closed(neutral + [message], tools)
        if full[: len(prompt)] != prompt:
            raise CodecError("chat template renders an assistant message differently after the generation prompt "
                             "(e.g. an injected think block); SFT targets would not be what the model generates")
        return full[len(prompt):]

    # ------------------------------------------------------------------ parsing
    def parse(self, token_ids: Sequence[int], turn: int, tools: Sequence[dict] | None = None) -> ParsedTurn:
        ids = list(token_ids)
        ended = bool(ids) and ids[-1] in self.stop_token_ids
        body = ids[:-1] if ended else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        request = self._request_cls(messages=[{"role": "user", "content": ""}], model="jointrl",
                                    tools=list(tools) if tools else None)
        errors: list[str] = []
        call_errors: list[str] = []
        if self._parser_cls is None:
            return ParsedTurn(message=Message(role="assistant", content=text.strip()), ended=ended)
        parser = self._parser_cls(self.tokenizer, request.tools)
        try:
            reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=body)
        except Exception as e:  # noqa: BLE001 - nothing a model writes may end the episode
            line = f"the reply could not be parsed by vLLM's {self.tool_parser_name!r} parser ({type(e).__name__}: {str(e)[:200]})"
            return ParsedTurn(message=Message(role="assistant", content=text), errors=(line,), call_errors=(line,), ended=ended)
        calls = list(calls or ())
        marker = getattr(parser.tool_parser, "tool_call_start_token", None) if parser.tool_parser is not None else None
        if isinstance(marker, str) and marker:
            dropped = text.count(marker) - len(calls)
            for i in range(max(dropped, 0)):
                call_errors.append(f"tool call {len(calls) + i}: a {marker} block that vLLM's {self.tool_parser_name!r} "
                                   "parser could not read (invalid JSON, or no name / arguments)")
        errors += call_errors
        if self.reasoning_markers and self.reasoning_markers[0] in text and self.reasoning_markers[1] not in text:
            errors.append(f"reasoning not closed by {self.reasoning_markers[1]}")
        msg = Message(role="assistant", content=(content or "").strip(),
                      tool_calls=tuple(ToolCall(id=tool_call_id(turn, i), name=c.name or "", arguments=c.arguments or "{}")
                                       for i, c in enumerate(calls)),
                      reasoning=(reasoning or "").strip() or None)
        return ParsedTurn(message=msg, errors=tuple(errors), call_errors=tuple(call_errors), ended=ended)


def checkpoint_template(checkpoint_dir: str | Path) -> str | None:
    """The chat template a checkpoint directory carries (chat_template.jinja or tokenizer_config.json), or None."""
    d = Path(checkpoint_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


def hf_codec(checkpoint_dir: str | Path, *, tool_parser: str = "hermes", reasoning_parser: str = "",
             tokenizer: Any = None) -> HfCodec:
    """The `hf` codec for a HF checkpoint directory (its tokenizer, chat_template and generation_config)."""
    d = Path(checkpoint_dir)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(d))
    if tool_parser == HARMONY_TOOL_PARSER:
        r = HarmonyRenderer()
        return HfCodec(tokenizer, r, tool_parser=tool_parser, reasoning_parser=reasoning_parser, eos_ids=r.stop_ids,
                       end_token_id=r.end_id)
    template = getattr(tokenizer, "chat_template", None) or checkpoint_template(d)
    if not template:
        raise CodecError(f"checkpoint {d}: no chat_template (tokenizer_config.json or chat_template.jinja); "
                         "the hf codec needs one (model.chat_codec=jointrl speaks the project's own format)")
    if getattr(tokenizer, "chat_template", None) != template:
        tokenizer.chat_template = template
    return HfCodec(tokenizer, JinjaRenderer(tokenizer, template), tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                   eos_ids=_eos_ids(d, tokenizer))


register_codec("hf")(hf_codec)
