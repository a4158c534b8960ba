"""Supervised warm start data: reference trajectories from the environments, as token episodes.

Each domain's task generator ships a scripted reference solution. We run it through the real
environment (sandbox, tools, grader) on *train* tasks only, keep the transcripts that score 1,
and render them with the chat format exactly as the agent loop would see them: prompt and tool
turns have loss mask 0, assistant completions (`model.chat.render_completion`) mask 1. The
result is a list of `Episode`s the trainer's `sft_step` consumes. Held-out tasks never appear.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from jointrl.records import Message, Task
from rl.log import get_logger
from rl.types import Episode

log = get_logger("sft")


def transcript_to_episode(task: Task, messages: Sequence[Message], tools: Sequence[dict], n_prompt: int, tok: Any,
                          chat: Any, reward: float = 1.0) -> Episode:
    """Tokens + loss mask for one finished conversation (`messages[:n_prompt]` is the prompt)."""
    ids: list[int] = list(tok.encode(chat.render(list(messages[:n_prompt]), tools, add_generation_prompt=True), add_special_tokens=False))
    mask = [0] * len(ids)
    i = n_prompt
    while i < len(messages):
        m = messages[i]
        if m.role != "assistant":
            raise ValueError(f"transcript of {task.id}: expected an assistant message at {i}, got {m.role}")
        out = tok.encode(chat.render_completion(m), add_special_tokens=False)
        ids += out
        mask += [1] * len(out)
        j = i + 1
        while j < len(messages) and messages[j].role != "assistant":
            j += 1
        if j < len(messages):  # more turns follow: append the tool/user turns and the next header
            nxt = tok.encode(chat.render_turn_suffix(list(messages[i + 1:j]), add_generation_prompt=True), add_special_tokens=False)
            ids += nxt
            mask += [0] * len(nxt)
        i = j
    return Episode(task_id=task.id, domain=task.domain, group_id=f"sft:{task.id}", token_ids=tuple(ids), loss_mask=tuple(mask),
                   rollout_logprobs=tuple([0.0] * len(ids)), messages=tuple(messages), reward=reward)


async def _reference_episode(make_env: Callable[[Task], Any], task: Task, tok: Any, chat: Any) -> Episode | None:
    from envs.play import policy_for

    env = make_env(task)
    try:
        prompt, tools = await env.reset(task)
        policy = policy_for(env, task, "reference")
        history = list(prompt)
        done = False
        turns = 0
        while not done and turns < task.limits.max_turns:
            a = await policy(history, tools)
            res = await env.step(a)
            history.append(a)
            history.extend(res.messages)
            done = res.terminated or res.truncated
            turns += 1
        grade = await env.grade()
        if grade.reward < 1.0 or grade.error:
            log.warning("reference solution of %s scored %s (%s); skipped for SFT", task.id, grade.reward, grade.error)
            return None
        # Drop trailing tool output after the final (episode-ending) call: nothing to learn from it.
        while history and history[-1].role != "assistant":
            history.pop()
        return transcript_to_episode(task, history, tools, len(prompt), tok, chat, grade.reward)
    finally:
        env.close()


async def reference_episodes(tasks: Sequence[Task], make_env: Callable[[Task], Any], tok: Any, chat: Any,
                             max_concurrent: int = 4) -> list[Episode]:
    sem = asyncio.Semaphore(max_concurrent)

    async def one(t: Task) -> Episode | None:
        async with sem:
            return await _reference_episode(make_env, t, tok, chat)

    out = await asyncio.gather(*(one(t) for t in tasks if t.split == "train"))
    return [e for e in out if e is not None]
