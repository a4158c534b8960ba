"""Reference solutions played through the agent loop, so a demonstration longer than the context is compacted as
the policy's own episodes are (rl/rollout/context.py): supervised data in the same segments RL trains on.

A reference transcript rendered whole (rl/sft.py) cannot train a policy whose context is smaller than the
transcript: it would be cut, or dropped. Here a scripted "engine" answers each request of a real agent-loop
episode with the codec's completion ids of the next reference call, and a summary request with a fixed note
(the reference has no summary of its own); the episode is then exactly what the loop would have built had the
policy written those turns, segments and all. Episodes that do not score 1 are dropped, as rl/sft.py drops
failing references; a `full` context is replaced by `window` for this (`demonstration_settings`), since a
reference that does not fit cannot be shown whole at all. What this module does not do: train (rl/sft.py does), or write summaries worth learning
from (a scripted reference cannot; its note only says where the progress is kept).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Sequence

from jointrl.records import Message, Task
from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_episode
from rl.rollout.context import SUMMARY_REQUEST
from rl.rollout.engine import GenerateRequest, GenerateResult
from rl.types import Episode

REFERENCE_SUMMARY = "My progress is in my tool calls so far; the most recent call and its result follow."
_NEUTRAL = [Message(role="user", content=".")]  # a one-line turn to render a completion after (as rl/sft.py does)


class _ReferencePlayer:
    """A GenerateBatch that plays one episode's reference calls in order (logprob 0: nothing was sampled)."""

    def __init__(self, codec: Any, calls: Sequence[Message]) -> None:
        self.codec = codec
        self.calls = list(calls)
        self.k = 0

    async def __call__(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        out = []
        for r in reqs:
            tail = self.codec.tokenizer.decode(list(r.prompt_token_ids[-160:]), skip_special_tokens=False)
            if SUMMARY_REQUEST[-40:] in tail:
                msg = Message(role="assistant", content=REFERENCE_SUMMARY)
            else:
                msg, self.k = self.calls[min(self.k, len(self.calls) - 1)], self.k + 1
            ids = list(self.codec.completion_ids(_NEUTRAL, msg, None))[: r.max_tokens]
            out.append(GenerateResult(token_ids=tuple(ids), logprobs=(0.0,) * len(ids), finish_reason="stop"))
        return out


def demonstration_settings(settings: LoopSettings) -> LoopSettings:
    """`settings` with `window` wherever the context strategy is `full`: a reference longer than the context cannot
    be shown whole, and in a window it can (the long-horizon rung's reference keeps its tally in its last call)."""
    c = settings.context
    swap = {d: ("window" if s == "full" else s) for d, s in c.by_domain.items()}
    context = dataclasses.replace(c, strategy="window" if c.strategy == "full" else c.strategy, by_domain=swap)
    return dataclasses.replace(settings, context=context)


async def reference_in_context(tasks: Sequence[Task], make_env: Callable[[Task], Any], codec: Any,
                               settings: LoopSettings, max_concurrent: int = 4) -> list[Episode]:
    """The reference episode of each task under `settings` (its context strategy included); those scoring 1."""
    from envs.base import messages_for_calls

    sem = asyncio.Semaphore(max_concurrent)

    async def one(task: Task) -> Episode | None:
        async with sem:
            env = make_env(task)
            player = _ReferencePlayer(codec, messages_for_calls(env.reference(task)))
            ep = await run_episode(env, task, BatchingGenerator(player), codec.tokenizer, codec, settings, group_id=task.id)
            assert isinstance(ep, Episode)
            return ep if ep.reward >= 1.0 and ep.grade_error is None else None

    out = await asyncio.gather(*(one(t) for t in tasks))
    return [e for e in out if e is not None]
