"""Running whole episodes without a model: scripted policies, `run_episode`, `play_env`, transcripts.

A `Policy` is an async callable `(messages, tool_schemas) -> assistant Message`. `ScriptedPolicy`
replays a fixed list of tool calls (a domain's reference solution, a do-nothing episode, an attack
script) and, when the script runs out, answers with plain text, which the framework treats as a
malformed turn until a budget ends the episode. The trainer's agent loop (rl/rollout) is the
model-driven counterpart; this module exists for the conformance checker, `jointrl envs play`,
tests and benchmarks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from envs.base import Env, ToolEnv, ToolInvocation, messages_for_calls
from jointrl.records import Grade, Message, Task

Policy = Callable[[Sequence[Message], Sequence[dict[str, Any]]], Awaitable[Message]]


class ScriptedPolicy:
    """Replays `invocations`, one tool call per turn."""

    def __init__(self, invocations: Sequence[ToolInvocation] | Sequence[Message]) -> None:
        items = list(invocations)
        self._messages = items if items and isinstance(items[0], Message) else messages_for_calls(items)  # type: ignore[arg-type]
        self._next = 0

    async def __call__(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> Message:
        if self._next < len(self._messages):
            self._next += 1
            return self._messages[self._next - 1]
        return Message(role="assistant", content="(the scripted policy has no more actions)")


@dataclass(frozen=True)
class Transcript:
    task: Task
    messages: tuple[Message, ...]
    grade: Grade
    terminated: bool
    truncated: bool
    turns: int
    wall_s: float

    def render(self, max_chars: int = 2000) -> str:
        """A readable transcript (long contents cut in the middle)."""
        def cut(s: str) -> str:
            return s if len(s) <= max_chars else s[: max_chars // 2] + f"\n[... {len(s) - max_chars} chars ...]\n" + s[-max_chars // 2:]

        lines = [f"# task {self.task.id} ({self.task.domain}, split {self.task.split})"]
        for m in self.messages:
            head = f"--- {m.role}" + (f" ({m.name})" if m.name else "") + (f" [{m.tool_call_id}]" if m.tool_call_id else "")
            lines.append(head)
            if m.content:
                lines.append(cut(m.content))
            for tc in m.tool_calls:
                lines.append(f"=> {tc.name}({cut(tc.arguments)}) [{tc.id}]")
        lines.append(f"--- result: reward={self.grade.reward:g} terminated={self.terminated} truncated={self.truncated} "
                     f"turns={self.turns} wall={self.wall_s:.2f}s")
        if self.grade.error:
            lines.append(f"grade error: {self.grade.error}")
        lines.append("metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(self.grade.metrics.items())))
        return "\n".join(lines)


async def run_episode(env: Env, task: Task, policy: Policy, *, max_steps: int = 10_000) -> Transcript:
    """reset -> (policy, step)* until terminated or truncated -> grade. The caller closes the env."""
    t0 = time.monotonic()
    messages, tools = await env.reset(task)
    history = list(messages)
    terminated = truncated = False
    turns = 0
    while not (terminated or truncated) and turns < max_steps:
        assistant = await policy(history, tools)
        res = await env.step(assistant)
        turns += 1
        history.append(assistant)
        history.extend(res.messages)
        terminated, truncated = res.terminated, res.truncated
    grade = await env.grade()
    return Transcript(task=task, messages=tuple(history), grade=grade, terminated=terminated, truncated=truncated,
                      turns=turns, wall_s=time.monotonic() - t0)


def policy_for(env: Env, task: Task, name: str) -> Policy:
    """"reference" (the domain's scripted solution) or "noop" (end the episode at once)."""
    if not isinstance(env, ToolEnv):
        raise TypeError(f"scripted policies need a ToolEnv, got {type(env).__name__}")
    if name == "reference":
        return ScriptedPolicy(env.reference(task))
    if name == "noop":
        return ScriptedPolicy(env.noop(task))
    raise ValueError(f"unknown policy {name!r}; choose 'reference' or 'noop'")


async def play_env_async(env_id: str, policy: str = "reference", *, split: str = "train", seed: int = 0,
                         index: int = 0, env_kwargs: dict[str, Any] | None = None) -> Transcript:
    from envs.registry import generate_tasks, make

    task = generate_tasks(env_id, split, seed, index + 1)[index]
    env = make(env_id, **(env_kwargs or {}))
    try:
        return await run_episode(env, task, policy_for(env, task, policy))
    finally:
        env.close()


def play_env(env_id: str, policy: str = "reference", **kw: Any) -> Transcript:
    """Run one episode of `env_id` with a scripted policy; returns its transcript (`.render()` to print)."""
    import asyncio

    return asyncio.run(play_env_async(env_id, policy, **kw))
