"""The chat-codec interface the agent loop, SFT and evaluation talk to, and the codec registry.

A codec turns typed messages (jointrl.records) into the token ids a checkpoint was trained on and the
token ids it generates back into typed messages. Everything is token-level so that an episode only
ever grows by appending: the prompt once, then per turn exactly the engine's tokens, then the ids of
the environment's turn (`turn_ids`, the template's delta). A codec never re-tokenises history.

What this module does not do: render any particular format (`jointrl.py`, `hf.py` do), talk to an
engine, or decide what an environment does with parse errors (`Env.step(parse_errors=)` does).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jointrl.records import Message


class CodecError(RuntimeError):
    """A codec cannot do what was asked (a template it cannot delta, a tokenizer without a stop id)."""


@dataclass(frozen=True)
class ParsedTurn:
    """One generated assistant turn, parsed.

    message: role "assistant" with content, reasoning (None when there is none) and the well-formed
        tool calls, ids `call_<turn>_<i>` (the `jointrl` codec's rule, whatever the format).
    errors: one line per problem found (malformed call, unclosed reasoning, stray text).
    call_errors: the lines of `errors` about tool calls that were dropped: the environment answers
        them as malformed calls.
    ended: the turn ended with one of the codec's stop tokens (False: cut at the length cap).
    """

    message: Message
    errors: tuple[str, ...] = ()
    call_errors: tuple[str, ...] = ()
    ended: bool = False


class ChatCodec(ABC):
    """A checkpoint's chat format, token-in / token-out.

    Attributes every codec sets:
    - `tokenizer`: the checkpoint's own tokenizer (encode / decode);
    - `stop_token_ids`: generation stops at any of these (the turn end first; then the tokenizer's
      and generation_config's eos ids);
    - `end_token_id`: the id that closes an assistant turn; the loop appends it (loss mask 0) when
      the engine stopped at the length cap, so the next turn starts at a clean boundary;
    - `pad_token_id`: padding for the trainer's batches (never trained on);
    - `reasoning_markers`: (start, end) strings of the format's thinking block, each one token, for
      vLLM's `ReasoningConfig` thinking budgets; None when the format has none (then a thinking tier
      only caps the turn's generated tokens);
    - `special_strings`: strings that text from a tool or user must never become (they would forge turns).
    """

    name: str = ""
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    end_token_id: int
    pad_token_id: int
    reasoning_markers: tuple[str, str] | None
    special_strings: tuple[str, ...]

    @abstractmethod
    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[int]:
        """Ids of the initial conversation plus the generation prompt (the model writes next)."""

    @abstractmethod
    def turn_ids(self, history: Sequence[Message], new_messages: Sequence[Message], tools: Sequence[dict] | None,
                 seen: Sequence[int] | None = None) -> list[int]:
        """Ids to append after an assistant turn that ended with a stop token: the environment's
        `new_messages` and the next generation prompt. `history` ends with that assistant message
        (as parsed); it lets the template see the context the new turn is rendered in. `seen`: the
        episode's tokens so far, for codecs that check the template against what the model saw."""

    @abstractmethod
    def parse(self, token_ids: Sequence[int], turn: int, tools: Sequence[dict] | None = None) -> ParsedTurn:
        """Parse what the engine generated for assistant turn number `turn` (0-based), the episode's
        `tools` at hand (some parsers type arguments by schema); never raises for what a model can write."""

    @abstractmethod
    def completion_ids(self, history: Sequence[Message], message: Message, tools: Sequence[dict] | None) -> list[int]:
        """Ids the model would generate for assistant `message` after `history` (SFT targets), ending
        with the turn's stop token."""


# ----------------------------------------------------------------------------- registry
CodecFactory = Callable[..., ChatCodec]
_CODECS: dict[str, CodecFactory] = {}


def register_codec(name: str) -> Callable[[CodecFactory], CodecFactory]:
    """Register a codec factory `(checkpoint_dir, *, tool_parser, reasoning_parser) -> ChatCodec` by name."""

    def deco(factory: CodecFactory) -> CodecFactory:
        if name in _CODECS:
            raise ValueError(f"chat codec {name!r} is already registered")
        _CODECS[name] = factory
        return factory

    return deco


def codec_names() -> tuple[str, ...]:
    return tuple(sorted(_CODECS))


def codec_factory(name: str) -> CodecFactory:
    if name not in _CODECS:
        raise KeyError(f"unknown chat codec {name!r}; registered: {', '.join(codec_names())}")
    return _CODECS[name]
