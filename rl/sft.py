"""Supervised warm start data: reference trajectories from the environments, as token episodes.

Each domain's task generator ships a scripted reference solution. We run it through the real
environment (sandbox, tools, grader) on *train* tasks only, keep the transcripts that score 1,
and tokenise them with the run's chat codec exactly as the agent loop would build them: prompt and
tool turns (`codec.prompt_ids`, `codec.turn_ids`) have loss mask 0, assistant completions
(`codec.completion_ids`) mask 1. The result is a list of `Episode`s the trainer's `sft_step` consumes
(`sft_warm_start` runs the steps). Held-out tasks never appear.
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
    """Tokens + loss mask for one finished conversation (`messages[:n_prompt]` is the prompt).

    `chat`: a `rl.rollout.codec.ChatCodec`, or a string-level format such as the `model.chat` module."""
    from model.chat import IM_END_ID
    from rl.rollout.codec import as_codec

    codec = as_codec(chat, tok, end_token_id=IM_END_ID)
    ids: list[int] = codec.prompt_ids(list(messages[:n_prompt]), tools)
    mask = [0] * len(ids)
    i = n_prompt
    while i < len(messages):
        m = messages[i]
        if m.role != "assistant":
            raise ValueError(f"transcript of {task.id}: expected an assistant message at {i}, got {m.role}")
        out = codec.completion_ids(list(messages[:i]), m, tools)
        ids += out
        mask += [1] * len(out)
        j = i + 1
        while j < len(messages) and messages[j].role != "assistant":
            j += 1
        if j < len(messages):  # more turns follow: append the tool/user turns and the next generation prompt
            nxt = codec.turn_ids(list(messages[:i + 1]), list(messages[i + 1:j]), tools, seen=ids)
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


def sft_data(rt: Any) -> list[Episode]:
    """The run's SFT set: reference trajectories of the first `trainer.sft_tasks_per_domain` *train* tasks
    of every weighted domain that score 1 and fit `rollout.max_model_len`. Built once per runtime (the
    warm start and the SFT control arm use the same set). Held-out tasks never enter it."""
    cached = getattr(rt, "_sft_episodes", None)
    if cached is not None:
        return cached
    per_domain = rt.cfg.trainer.sft_tasks_per_domain or max(4, rt.cfg.trainer.tasks_per_step * 4)
    tasks = [t for d in rt.domains for t in rt.train_tasks[d][:per_domain]]
    eps = asyncio.run(reference_episodes(tasks, rt.make_env, rt.tok, rt.codec, max_concurrent=rt.cfg.envs.sandbox_slots))
    eps = [e for e in eps if len(e.token_ids) <= rt.cfg.rollout.max_model_len]
    rt._sft_episodes = eps
    return eps


def sft_train(rt: Any, steps: int | None = None, seconds: float | None = None, label: str = "sft",
              seed_offset: int = 0) -> dict[str, float]:
    """Supervised steps on `sft_data(rt)` through the runtime's trainer: `steps` of them, or as many as fit in
    `seconds` of wall time (the SFT control arm: SFT continued for as long as RL ran). Batches are
    `trainer.micro_batch_size` trajectories drawn without replacement per step. The engines are not synced."""
    import json
    import random
    import time

    from rl.log import progress

    if (steps is None) == (seconds is None):
        raise ValueError("sft_train: give exactly one of steps or seconds")
    eps = sft_data(rt)
    if not eps:
        log.warning("%s: no reference trajectories; no supervised steps", label)
        return {}
    log.info("%s: %d reference trajectories, %s", label, len(eps), f"{steps} steps" if steps is not None else f"{seconds:.0f} s")
    rng = random.Random(rt.cfg.model.seed + seed_offset)
    rt.trainer.set_lr(rt.cfg.trainer.sft_lr)
    m: dict[str, float] = {}
    bs = max(1, rt.cfg.trainer.micro_batch_size)
    t0 = time.perf_counter()
    done = 0
    bar = progress(range(steps) if steps is not None else iter(int, 1), desc=label, total=steps)
    with open(rt.run_dir / f"{label}_metrics.jsonl", "a", encoding="utf-8") as f:
        for i in bar:
            if seconds is not None and time.perf_counter() - t0 >= seconds:
                break
            chosen = rng.sample(eps, min(bs, len(eps)))
            batch = rt.batch_of(chosen, [0.0] * len(chosen))
            m = rt.trainer.sft_step(batch)
            done += 1
            f.write(json.dumps({"sft_step": done - 1, **m}) + "\n")
            f.flush()  # watchable while the run goes on
            bar.set_postfix_str(f"nll {m.get('sft/nll', float('nan')):.3f}")
    rt.trainer.set_lr(rt.cfg.trainer.lr)
    rt.refresh_versions()
    return {**m, "sft/trajectories": float(len(eps)), "sft/steps": float(done), "sft/seconds": time.perf_counter() - t0}


def sft_warm_start(rt: Any, steps: int) -> dict[str, float]:
    """Supervised warm start on reference trajectories of train tasks (all weighted domains), through
    the runtime's trainer (`rt`: rl.runtime.Runtime); the engines are not synced here."""
    return sft_train(rt, steps=steps, label="sft")
