"""Chat codecs by name: how a checkpoint's messages become tokens and its generations become messages.

- `jointrl`: the project's own format (model/chat.py), for the shipped HybridMoe shapes and any
  checkpoint carrying the shipped tokenizer.
- `hf`: the checkpoint's own `chat_template` (or harmony), parsed with vLLM's tool / reasoning parsers.

`model.chat_codec: auto` (the default) follows the checkpoint (`default_codec_name`). `make_codec`
builds one; `parser_name_problem` checks `model.tool_parser` / `model.reasoning_parser` against
vLLM's registries (used by rl/config.py). Importing this package is cheap: vLLM and transformers
load only when an `hf` codec is built or a parser name is checked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rl.rollout.codec.base import ChatCodec, CodecError, ParsedTurn, codec_factory, codec_names, register_codec
from rl.rollout.codec import jointrl as _jointrl  # noqa: F401 - registers "jointrl"
from rl.rollout.codec import hf as _hf  # noqa: F401 - registers "hf"
from rl.rollout.codec.hf import checkpoint_template
from rl.rollout.codec.jointrl import TextFormatCodec

AUTO = "auto"

__all__ = ["AUTO", "ChatCodec", "CodecError", "ParsedTurn", "TextFormatCodec", "as_codec", "codec_names",
           "default_codec_name", "make_codec", "parser_name_problem", "register_codec", "resolve_codec_name"]


def default_codec_name(arch: str) -> str:
    """`jointrl` for a shipped shape name or a checkpoint dir whose template is the shipped one (or that
    has none: it gets the shipped tokenizer); `hf` for a checkpoint dir with a chat template of its own."""
    d = Path(arch)
    if not (d.is_dir() and (d / "config.json").exists()):
        return "jointrl"
    template = checkpoint_template(d)
    if template is None:
        return "jointrl"
    from model.chat import CHAT_TEMPLATE

    return "jointrl" if template == CHAT_TEMPLATE else "hf"


def resolve_codec_name(chat_codec: str, arch: str) -> str:
    return default_codec_name(arch) if chat_codec == AUTO else chat_codec


def make_codec(name: str, checkpoint_dir: str | Path | None, *, tool_parser: str = "hermes", reasoning_parser: str = "",
               tokenizer: Any = None) -> ChatCodec:
    """Build the registered codec `name` for a checkpoint directory."""
    return codec_factory(name)(checkpoint_dir, tool_parser=tool_parser, reasoning_parser=reasoning_parser, tokenizer=tokenizer)


def parser_name_problem(kind: str, name: str) -> str:
    """Why `name` is not a registered vLLM tool (`kind="tool"`) or reasoning parser, or "" if it is
    (the allowed values are listed). Imports vLLM's registries (a few seconds)."""
    if kind == "tool":
        from vllm.tool_parsers import ToolParserManager

        allowed = ToolParserManager.list_registered()
    else:
        from vllm.reasoning import ReasoningParserManager

        allowed = ReasoningParserManager.list_registered()
    if name in allowed:
        return ""
    return f"{name!r} is not a registered vLLM {kind} parser; allowed values: {', '.join(allowed)}"


def as_codec(codec: Any, tokenizer: Any, *, end_token_id: int, special_strings: tuple[str, ...] = ()) -> ChatCodec:
    """A ChatCodec as is; a string-level format (an object with model/chat.py's `render`,
    `render_turn_suffix`, `parse_assistant`) wrapped with `tokenizer` and `end_token_id`."""
    if isinstance(codec, ChatCodec):
        return codec
    return TextFormatCodec(tokenizer, codec, end_token_id=end_token_id, special_strings=special_strings,
                           reasoning_markers=_markers(codec))


def _markers(fmt: Any) -> tuple[str, str]:
    """A string-level format's thinking markers; model/chat.py's `<think>` / `</think>` unless it names its own."""
    return (getattr(fmt, "REASONING_START_STR", "<think>"), getattr(fmt, "REASONING_END_STR", "</think>"))


def reasoning_token_ids(codec: ChatCodec) -> tuple[int, int] | None:
    """The token ids of the codec's thinking markers (start, end); None when its format has no thinking block
    (`reasoning_markers` is None) or a marker is not one token. Telemetry counts thinking tokens between them."""
    if codec.reasoning_markers is None:
        return None
    ids = [codec.tokenizer.encode(s, add_special_tokens=False) for s in codec.reasoning_markers]
    if any(len(i) != 1 for i in ids):
        return None
    return int(ids[0][0]), int(ids[1][0])
