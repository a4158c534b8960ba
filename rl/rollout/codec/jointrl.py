"""The `jointrl` codec: the project's own chat format (model/chat.py) behind the ChatCodec interface.

Behaviour is model/chat.py's, unchanged: the prompt is `render(..., add_generation_prompt=True)`,
an environment turn is `render_turn_suffix(new)` (every boundary sits just after a special token, so
encoding the pieces apart equals encoding the whole, docs/chat_format.md), parsing is
`parse_assistant`. `TextFormatCodec` wraps any object with those string-level functions (the module
itself, or a test's variant of it) with a tokenizer and the stop / pad ids.

What it does not do: read a checkpoint's chat_template (that is the `hf` codec).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from jointrl.records import Message
from rl.rollout.codec.base import ChatCodec, CodecError, ParsedTurn, register_codec


class TextFormatCodec(ChatCodec):
    """A string-level chat format (`render`, `render_turn_suffix`, `parse_assistant`, optionally
    `render_completion`) plus a tokenizer, as a token-level ChatCodec."""

    name = "jointrl"

    def __init__(self, tokenizer: Any, fmt: Any, *, end_token_id: int, stop_token_ids: Sequence[int] | None = None,
                 pad_token_id: int = 0, reasoning_markers: tuple[str, str] | None = None,
                 special_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.end_token_id = int(end_token_id)
        self.stop_token_ids = tuple(int(i) for i in (stop_token_ids if stop_token_ids is not None else (end_token_id,)))
        self.pad_token_id = int(pad_token_id)
        self.reasoning_markers = reasoning_markers
        self.special_strings = tuple(special_strings)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[int]:
        return self._encode(self.fmt.render(list(messages), tools, add_generation_prompt=True))

    def turn_ids(self, history: Sequence[Message], new_messages: Sequence[Message], tools: Sequence[dict] | None,
                 seen: Sequence[int] | None = None) -> list[int]:
        return self._encode(self.fmt.render_turn_suffix(list(new_messages)))

    def parse(self, token_ids: Sequence[int], turn: int, tools: Sequence[dict] | None = None) -> ParsedTurn:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        p = self.fmt.parse_assistant(text, turn=turn)
        return ParsedTurn(message=p.message, errors=tuple(p.errors), call_errors=tuple(getattr(p, "call_errors", ())),
                          ended=bool(getattr(p, "ended", bool(token_ids) and token_ids[-1] in self.stop_token_ids)))

    def completion_ids(self, history: Sequence[Message], message: Message, tools: Sequence[dict] | None) -> list[int]:
        return self._encode(self.fmt.render_completion(message))


def jointrl_codec(checkpoint_dir: str | Path | None = None, *, tool_parser: str = "", reasoning_parser: str = "",
                  tokenizer: Any = None) -> TextFormatCodec:
    """model/chat.py with the shipped tokenizer (the checkpoint's copy of it when `checkpoint_dir` has one).
    `tool_parser` / `reasoning_parser` are the hf codec's; this format parses itself."""
    from model import chat

    if tokenizer is None:
        own = checkpoint_dir is not None and (Path(checkpoint_dir) / "tokenizer.json").exists()
        try:
            tokenizer = chat.load_tokenizer(checkpoint_dir if own else chat.TOKENIZER_DIR)
        except ValueError as e:  # a checkpoint with a tokenizer of its own
            raise CodecError(f"the jointrl chat codec needs the shipped tokenizer's special-token ids, and {checkpoint_dir} "
                             f"has a tokenizer of its own ({e}); use model.chat_codec=hf (or auto)") from e
    tok = tokenizer
    # Stops at <|im_end|> only, as the agent loop always has (<|endoftext|> never ends a chat turn here).
    return TextFormatCodec(tok, chat, end_token_id=chat.IM_END_ID, stop_token_ids=(chat.IM_END_ID,),
                           pad_token_id=chat.PAD_ID, reasoning_markers=(chat.REASONING_START_STR, chat.REASONING_END_STR),
                           special_strings=chat.STRUCTURE_TOKENS)


register_codec("jointrl")(jointrl_codec)
