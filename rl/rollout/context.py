"""Context management: what an episode keeps in its context once its history outgrows a token budget.

The agent loop (rl/rollout/agent_loop.py) calls a strategy when appending the next observation would take the
context past its budget. The strategy returns the messages of a fresh, smaller context (always starting with the
episode's first messages: the system prompt and the task) or None, and the episode then ends as truncated.
A fresh context is a new *segment*: the loop renders it once, and from there on only appends, so every segment
holds exactly the tokens the engine was given and generated while it lasted (token-in / token-out per segment).

Strategies (registry `CONTEXT_STRATEGIES`; `rollout.context`, overridable per domain):
- `full`: never compacts; the episode ends as truncated when the next turn no longer fits `max_model_len`.
- `window`: drops the oldest whole turns (an assistant message with the tool results that answer it). With
  `keep_turns` > 0 the most recent `keep_turns` turns stay ("recent N turns"); with 0 the most recent turns that
  fit half the budget stay ("token budget": half, so that the next compaction is many turns away, since each one
  costs a prefill of the new context). Turns that do not fit the budget go too.
- `summarize`: the policy itself is asked, with a user message in its own chat format, to write a summary of its
  progress, right after the turn whose observation went over the budget; that reply is generated and trained like
  any other turn, and the next context is the first messages, the summary, and that last turn (the call and its
  observation, so the next turn answers it). A summary that is empty, cut at the token cap or holds special-token text reaches the next
  context with a note saying so (special-token text broken up); one that does not fit the budget ends the episode.

A strategy is `async (CompactionView) -> Compacted | None`; register one with `@CONTEXT_STRATEGIES.register(name)`.
What this module does not do: render or tokenise (the view's `count` and `ask`, given by the loop, do), or
decide when to compact (the loop does, from `ContextSettings`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from jointrl.records import Message
from model import chat
from rl.algos.registry import Registry


@dataclass(frozen=True)
class ContextSettings:
    """`strategy`: a registered name; `budget_tokens`: the context size that triggers a compaction (0: the
    loop's default, see `budget_for`); `keep_turns`: window's "recent N turns" form (0: its token-budget form);
    `by_domain`: domain -> strategy name, overriding `strategy` for that domain's episodes."""

    strategy: str = "full"
    budget_tokens: int = 0
    keep_turns: int = 0
    by_domain: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (self.strategy, *self.by_domain.values()):
            CONTEXT_STRATEGIES.get(name)
        if self.budget_tokens < 0 or self.keep_turns < 0:
            raise ValueError(f"ContextSettings: budget_tokens={self.budget_tokens} and keep_turns={self.keep_turns} must be >= 0")

    def strategy_for(self, domain: str) -> str:
        return self.by_domain.get(domain, self.strategy)

    def budget_for(self, strategy: str, max_model_len: int, turn_tokens: int) -> int:
        """The budget in tokens. Default: room for one more full turn (`window`); for `summarize`, room for one
        more turn, the summary request and the summary (asked right after the turn that went over)."""
        if self.budget_tokens:
            return min(self.budget_tokens, max_model_len)
        reserve = 2 * turn_tokens + SUMMARY_REQUEST_TOKENS if strategy == "summarize" else turn_tokens
        return max(max_model_len - reserve, 1)


@dataclass(frozen=True)
class Reply:
    """The policy's reply to an `ask`: its text (answer part, without reasoning or tool calls) and whether the
    engine stopped it at the token cap."""

    text: str
    capped: bool


@dataclass
class CompactionView:
    """What a strategy sees: the first messages (`head`, never dropped), the later history in whole turns,
    oldest first (the last turn ends with the observation that filled the context), and the loop's helpers."""

    head: list[Message]
    turns: list[list[Message]]
    budget: int
    keep_turns: int
    count: Callable[[Sequence[Message]], int]  # tokens of a context holding these messages
    # append messages to the current context (before the observation that went over), generate one turn
    ask: Callable[[Sequence[Message]], Awaitable[Reply | None]]
    special_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Compacted:
    """The next context's messages; `dropped_turns`: how many whole turns of history it no longer holds;
    `problem`: what was wrong with a summary, "" when nothing was (counted in the episode's metrics)."""

    messages: list[Message]
    dropped_turns: int
    problem: str = ""


Strategy = Callable[[CompactionView], Awaitable["Compacted | None"]]
CONTEXT_STRATEGIES: Registry[Strategy] = Registry("context strategy")


def split_turns(messages: Sequence[Message]) -> list[list[Message]]:
    """History after the first messages, as turns: each starts at an assistant message and holds the messages
    that answer it (a leading non-assistant message, which a well-formed episode has none of, is a turn alone)."""
    turns: list[list[Message]] = []
    for m in messages:
        if m.role == "assistant" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


@CONTEXT_STRATEGIES.register("full")
async def _full(view: CompactionView) -> Compacted | None:
    return None


@CONTEXT_STRATEGIES.register("window")
async def _window(view: CompactionView) -> Compacted | None:
    n = len(view.turns)
    target = view.budget if view.keep_turns else view.budget // 2
    keep = min(view.keep_turns or n - 1, n - 1)  # at least one turn goes, or nothing changes
    while keep >= 1:  # the last turn holds the observation that answers the last call: it always stays
        msgs = view.head + [m for t in view.turns[n - keep:] for m in t]
        if view.count(msgs) <= target:
            return Compacted(messages=msgs, dropped_turns=n - keep)
        keep -= 1
    msgs = view.head + view.turns[-1]
    return Compacted(messages=msgs, dropped_turns=n - 1) if n > 1 and view.count(msgs) <= view.budget else None


SUMMARY_REQUEST_TOKENS = 96  # what the request costs in a context, chat template included, with room to spare
SUMMARY_REQUEST = ("Your context is full. Write a summary of your progress for yourself: the facts you found that you "
                   "still need, what you have done, and what is left to do. Reply with the summary only, without a tool "
                   "call; the conversation then continues from the task and this summary.")
SUMMARY_HEADER = "Summary of your progress so far, written by you when your context filled up:\n"
EMPTY_SUMMARY = "(You wrote an empty summary: what you did before is lost.)"
CUT_NOTE = "\n[Your summary was cut at the token limit.]"
SPECIAL_NOTE = "\n[Special-token text in your summary was broken up.]"


def summary_message(reply: Reply, special_strings: Sequence[str]) -> tuple[Message, str]:
    """The user message that carries a summary into the next context, and what was wrong with it ("" if nothing)."""
    text = reply.text.strip()
    problems = []
    if not text:
        text, problems = EMPTY_SUMMARY, ["empty"]
    clean = chat.defuse(text, tuple(special_strings))
    if clean != text:
        text, problems = clean + SPECIAL_NOTE, problems + ["special"]
    if reply.capped:
        text, problems = text + CUT_NOTE, problems + ["cut"]
    return Message(role="user", content=SUMMARY_HEADER + text), "+".join(problems)


@CONTEXT_STRATEGIES.register("summarize")
async def _summarize(view: CompactionView) -> Compacted | None:
    reply = await view.ask([Message(role="user", content=SUMMARY_REQUEST)])
    if reply is None:
        return None
    msg, problem = summary_message(reply, view.special_strings)
    msgs = view.head + [msg] + view.turns[-1]
    if view.count(msgs) > view.budget:
        return None  # too long for the next context even after the turn cap: the episode ends as truncated
    return Compacted(messages=msgs, dropped_turns=len(view.turns), problem=problem)


def strategy_names() -> tuple[str, ...]:
    return tuple(CONTEXT_STRATEGIES.names())
