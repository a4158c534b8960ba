"""Supervised warm start data: trajectories on train tasks, replayed in the environments, as token episodes.

Two sources, one per run:

* the domains' scripted reference solutions (the default): run through the real environment
  (sandbox, tools, grader) on *train* tasks only; transcripts that do not score 1 are dropped, since a
  failing reference is a domain bug;
* a demonstration file (`trainer.sft_data`): the assistant turns of an outside source, such as a teacher
  model or people, one JSON line per task (`{"task_id": ..., "messages": [assistant messages in the
  OpenAI format]}`). The turns are replayed in the real environment, so tool results are the
  environment's own, and the set is kept as given whatever it scores: it is the user's data. Its graded
  reward is logged and returned (`sft/data_reward`), so a run shows how good its demonstrations were.
  Ids must name train tasks of the run's domains; a held-out id is refused.

Either way the transcripts are tokenised with the run's chat codec exactly as the agent loop builds
them: prompt and tool turns (`codec.prompt_ids`, `codec.turn_ids`) have loss mask 0, assistant
completions (`codec.completion_ids`) mask 1. The result is a list of `Episode`s the trainer's
`sft_step` consumes (`sft_warm_start` runs the steps). Held-out tasks never appear.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from jointrl.records import Message, Task
from rl.log import get_logger
from rl.types import Episode, SftStats, SftStepResult

if TYPE_CHECKING:
    from rl.config import TrainerSection

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


@dataclass(frozen=True)
class Demonstration:
    """One task's assistant turns from a demonstration file (`trainer.sft_data`)."""

    task_id: str
    actions: tuple[Message, ...]


def read_demonstrations(path: str | Path, train: Mapping[str, Task], heldout_ids: set[str],
                        key: str = "trainer.sft_data") -> list[tuple[Task, Demonstration]]:
    """Parse and check a demonstration file against the run's task pools (`train`: id -> train task).

    Raises `ConfigError` naming `key` and the line for: unreadable JSON, a line without `task_id` or
    `messages`, a message that is not the assistant's, an id of a held-out task (held-out tasks never feed
    training), an id the run's train pools do not hold, or a file with no demonstrations."""
    from rl.config import ConfigError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config key '{key}': {str(path)!r} is not a file")
    out: list[tuple[Task, Demonstration]] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"config key '{key}': {p}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("task_id"), str) or not isinstance(row.get("messages"), list):
            raise ConfigError(f'{where}: each line must be {{"task_id": str, "messages": [assistant messages]}}')
        tid = row["task_id"]
        if tid in heldout_ids:
            raise ConfigError(f"{where}: task {tid!r} is a held-out task; demonstrations may use train tasks only")
        if tid not in train:
            raise ConfigError(f"{where}: task {tid!r} is not a train task of this run's domains (envs.weights, envs.seed)")
        try:
            msgs = tuple(Message.from_openai(m) for m in row["messages"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where}: a message is not in the OpenAI chat format ({e})") from None
        bad = [m.role for m in msgs if m.role != "assistant"]
        if bad or not msgs:
            raise ConfigError(f"{where}: give the assistant's messages only (tool results come from replaying them); "
                              f"got roles {bad or 'none'}")
        out.append((train[tid], Demonstration(tid, msgs)))
    if not out:
        raise ConfigError(f"config key '{key}': {p} holds no demonstrations")
    return out


async def _replayed_episode(make_env: Callable[[Task], Any], task: Task, tok: Any, chat: Any,
                             actions: Sequence[Message] | None = None) -> Episode | None:
    """The episode of `task` played by `actions` (a demonstration, kept whatever it scores) or, when None, by
    the domain's reference solution (dropped unless it scores 1)."""
    from envs.play import ScriptedPolicy, policy_for

    env = make_env(task)
    try:
        prompt, tools = await env.reset(task)
        policy = ScriptedPolicy(list(actions)) if actions is not None else policy_for(env, task, "reference")
        history = list(prompt)
        done = False
        turns = 0
        # A demonstration ends with its last turn (or the episode's end, or its turn limit, which drops the rest).
        last = min(task.limits.max_turns, len(actions)) if actions is not None else task.limits.max_turns
        while not done and turns < last:
            a = await policy(history, tools)
            res = await env.step(a)
            history.append(a)
            history.extend(res.messages)
            done = res.terminated or res.truncated
            turns += 1
        grade = await env.grade()
        if actions is None and (grade.reward < 1.0 or grade.error):
            log.warning("reference solution of %s scored %s (%s); skipped for SFT", task.id, grade.reward, grade.error)
            return None
        # Drop trailing tool output after the final (episode-ending) call: nothing to learn from it.
        while history and history[-1].role != "assistant":
            history.pop()
        return transcript_to_episode(task, history, tools, len(prompt), tok, chat, grade.reward)
    finally:
        env.close()


async def reference_episodes(tasks: Sequence[Task], make_env: Callable[[Task], Any], tok: Any, chat: Any,
                             max_concurrent: int = 4, actions: Sequence[Sequence[Message]] | None = None) -> list[Episode]:
    """Episodes of the *train* tasks among `tasks`, played by the references or, given `actions` (one list per
    task), by those turns."""
    sem = asyncio.Semaphore(max_concurrent)
    plays = list(actions) if actions is not None else [None] * len(tasks)
    if len(plays) != len(tasks):
        raise ValueError(f"reference_episodes: {len(tasks)} tasks but {len(plays)} action lists")

    async def one(t: Task, a: Sequence[Message] | None) -> Episode | None:
        async with sem:
            return await _replayed_episode(make_env, t, tok, chat, a)

    out = await asyncio.gather(*(one(t, a) for t, a in zip(tasks, plays) if t.split == "train"))
    return [e for e in out if e is not None]


class SftSet:
    """The run's SFT set, built once (the warm start and the SFT control arm use the same set): with
    `trainer.sft_data`, that file's demonstrations (read and checked against the task pools at `load`, so a bad
    file fails before Ray or the trainer start) replayed as given; otherwise reference trajectories of the first
    `trainer.sft_tasks_per_domain` *train* tasks of every weighted domain that score 1. Episodes longer than
    `rollout.max_model_len` are left out. Held-out tasks never enter it."""

    def __init__(self, pools: Any, *, sft_data: str = "", tasks_per_domain: int = 0, sandbox_slots: int = 4,
                 max_model_len: int, demonstrations: list[tuple[Task, Demonstration]] | None = None) -> None:
        self.pools = pools  # rl.tasks.TaskPools
        self.sft_data = sft_data  # trainer.sft_data
        self.tasks_per_domain = tasks_per_domain  # the resolved trainer.sft_tasks_per_domain
        self.sandbox_slots = sandbox_slots  # envs.sandbox_slots: concurrent sandboxes of the replays
        self.max_model_len = max_model_len
        self.demonstrations = demonstrations
        self._episodes: list[Episode] | None = None

    @classmethod
    def load(cls, pools: Any, trainer: TrainerSection, *, sandbox_slots: int, max_model_len: int) -> "SftSet":
        """The set of the `trainer` section's SFT keys; the demonstration file, if any, read and checked now."""
        demos = read_pool_demonstrations(trainer.sft_data, pools) if trainer.sft_data else None
        return cls(pools, sft_data=trainer.sft_data, sandbox_slots=sandbox_slots, max_model_len=max_model_len,
                   tasks_per_domain=trainer.sft_tasks_per_domain or max(4, trainer.tasks_per_step * 4), demonstrations=demos)

    def episodes(self, rollouts: Any) -> list[Episode]:
        """The set as token episodes, replayed in the environments `rollouts` makes, tokenised with its codec."""
        if self._episodes is not None:
            return self._episodes
        make_env, tok, codec, slots = rollouts.make_env, rollouts.tok, rollouts.codec, self.sandbox_slots
        if self.sft_data:
            demos = self.demonstrations if self.demonstrations is not None else read_pool_demonstrations(self.sft_data, self.pools)
            eps = asyncio.run(reference_episodes([t for t, _ in demos], make_env, tok, codec, max_concurrent=slots,
                                                 actions=[d.actions for _, d in demos]))
            mean = sum(e.reward for e in eps) / max(1, len(eps))
            log.info("SFT data: %d demonstrations from %s, replayed reward %.3f (used as given)", len(eps), self.sft_data, mean)
        else:
            tasks = [t for d in self.pools.domains for t in self.pools.train[d][:self.tasks_per_domain]]
            eps = asyncio.run(reference_episodes(tasks, make_env, tok, codec, max_concurrent=slots))
            # References longer than the context: played through the agent loop with the run's context strategy
            # (`window` where it is `full`, which could not show them at all), so they come in segments that fit.
            long_ids = {e.task_id for e in eps if len(e.token_ids) > self.max_model_len}
            if long_ids:
                from rl.rollout.replay import demonstration_settings, reference_in_context

                eps = [e for e in eps if e.task_id not in long_ids] + asyncio.run(reference_in_context(
                    [t for t in tasks if t.id in long_ids], make_env, codec, demonstration_settings(rollouts.loop_settings()),
                    max_concurrent=slots))
        self._episodes = [e for e in eps if len(e.token_ids) <= self.max_model_len]
        return self._episodes


def read_pool_demonstrations(path: str, pools: Any) -> list[tuple[Task, Demonstration]]:
    """`trainer.sft_data` read and checked against the task pools (`pools.train`, `pools.heldout`)."""
    train = {t.id: t for d in pools.domains for t in pools.train[d]}
    heldout = {t.id for d in pools.domains for t in pools.heldout.get(d, ())}
    return read_demonstrations(path, train, heldout)


SFT_META = "sft_meta.json"  # in an SFT checkpoint directory: {"sft_step": steps done, "steps": planned, "done": bool}


def read_sft_checkpoint(ckpt_dir: Path | None) -> dict[str, Any] | None:
    """The meta of a complete SFT checkpoint in `ckpt_dir`, or None."""
    if ckpt_dir is None or not (Path(ckpt_dir) / SFT_META).is_file():
        return None
    try:
        return json.loads((Path(ckpt_dir) / SFT_META).read_text())
    except (OSError, ValueError):
        return None


def _save_sft_checkpoint(policy: Any, ckpt_dir: Path, done: int, steps: int, seconds: float) -> None:
    """The trainer state after `done` supervised steps; the meta file is written last, atomically, so a kill
    mid-save leaves the previous checkpoint (or none) valid."""
    (Path(ckpt_dir) / SFT_META).unlink(missing_ok=True)
    policy.save_checkpoint(str(ckpt_dir))
    tmp = Path(ckpt_dir) / (SFT_META + ".tmp")
    tmp.write_text(json.dumps({"sft_step": done, "steps": steps, "done": done >= steps, "seconds": seconds}))
    tmp.replace(Path(ckpt_dir) / SFT_META)
    log.info("SFT checkpoint saved at SFT step %d of %d (%s)", done, steps, ckpt_dir)


def sft_train(policy: Any, episodes: Sequence[Episode], trainer: TrainerSection, run_dir: Path, *, seed: int, steps: int | None = None,
              seconds: float | None = None, label: str = "sft", seed_offset: int = 0, checkpoint_dir: Path | None = None,
              checkpoint_every: int = 0) -> SftStats:
    """Supervised steps on `episodes` (the run's SFT set) through `policy` (rl.trainer.client.PolicyClient): `steps`
    of them, or as many as fit in `seconds` of wall time (the SFT control arm: SFT continued for as long as RL ran).
    Batches are `trainer.micro_batch_size` trajectories drawn without replacement per step (`seed`: model.seed) at
    `trainer.sft_lr`, then the rate goes back to `trainer.lr`. The engines are not synced.

    With `checkpoint_dir` (a step count only): the trainer state is saved there every `checkpoint_every` steps
    (0: only at the end) and at the end, and a checkpoint found there is resumed: its steps are not redone and
    the batch sampler skips the draws they made, so the resumed steps see the batches an uninterrupted run would."""
    import random
    import time

    from rl.log import progress

    if (steps is None) == (seconds is None):
        raise ValueError("sft_train: give exactly one of steps or seconds")
    eps = list(episodes)
    if not eps:
        log.warning("%s: no reference trajectories; no supervised steps", label)
        return SftStats()
    rng = random.Random(seed + seed_offset)
    bs = max(1, trainer.micro_batch_size)
    start, prior_s = 0, 0.0
    meta = read_sft_checkpoint(checkpoint_dir) if steps is not None else None
    if meta is not None:
        policy.load_checkpoint(str(checkpoint_dir))
        start, prior_s = min(int(meta["sft_step"]), steps), float(meta.get("seconds", 0.0))
        for _ in range(start):
            rng.sample(eps, min(bs, len(eps)))  # the draws of the steps already done
        log.warning("%s: resumed from its checkpoint at SFT step %d of %d (%s)", label, start, steps, checkpoint_dir)
    log.info("%s: %d trajectories, %s", label, len(eps), f"{steps} steps" if steps is not None else f"{seconds:.0f} s")
    policy.set_lr(trainer.sft_lr)
    last: SftStepResult | None = None
    t0 = time.perf_counter()
    done = start
    # A step count: one tick per step. A time budget (the control arm): the bar counts its seconds, so its ETA is the
    # budget's end and the steps done show beside it.
    bar = progress(desc=label, total=steps, initial=start) if steps is not None else \
        progress(desc=label, total=int(round(seconds)), unit="s")
    ticks = range(start, steps) if steps is not None else iter(int, 1)
    with open(Path(run_dir) / f"{label}_metrics.jsonl", "a", encoding="utf-8") as f:
        for _ in ticks:
            if seconds is not None and time.perf_counter() - t0 >= seconds:
                break
            chosen = rng.sample(eps, min(bs, len(eps)))
            batch = policy.batch_of(chosen, [0.0] * len(chosen))
            last = policy.sft_step(batch)
            done += 1
            f.write(json.dumps({"sft_step": done - 1, **last.as_metrics()}) + "\n")
            f.flush()  # watchable while the run goes on
            bar.update(1 if steps is not None else min(int(time.perf_counter() - t0), bar.total) - bar.n)
            nll = last.nll if last.nll is not None else float("nan")
            bar.set_postfix_str(f"{'' if steps is not None else f'step {done}, '}nll {nll:.3f}")
            if checkpoint_dir is not None and steps is not None and checkpoint_every and done % checkpoint_every == 0 \
                    and done < steps:
                _save_sft_checkpoint(policy, checkpoint_dir, done, steps, prior_s + time.perf_counter() - t0)
    bar.close()
    policy.set_lr(trainer.lr)
    if checkpoint_dir is not None and steps is not None and done > start:
        _save_sft_checkpoint(policy, checkpoint_dir, done, steps, prior_s + time.perf_counter() - t0)
    policy.refresh_versions()
    return SftStats(last=last, trajectories=len(eps), data_reward=sum(e.reward for e in eps) / len(eps), steps=done,
                    seconds=prior_s + time.perf_counter() - t0)


def sft_warm_start(policy: Any, episodes: Sequence[Episode], trainer: TrainerSection, run_dir: Path, *, seed: int, steps: int,
                   checkpoint_dir: Path | None = None) -> SftStats:
    """Supervised warm start on the run's SFT set (`SftSet`: references or `trainer.sft_data`), checkpointed in
    `checkpoint_dir` every `trainer.checkpoint_every` steps and at its end, and resumed from there; the engines
    are not synced here."""
    return sft_train(policy, episodes, trainer, run_dir, seed=seed, steps=steps, label="sft", checkpoint_dir=checkpoint_dir,
                     checkpoint_every=trainer.checkpoint_every)
