"""Partial rollouts: a step stops generating once its budget is spent; unfinished episodes continue next step.

Without them a step waits for its slowest episode: one episode ten times longer than the others holds the whole
batch (and the trainer) for its length. With `rollout.partial: on`, each step gets a budget of generated tokens
(`rollout.step_token_budget`) and/or of wall time (`rollout.step_time_budget_s`), a `StepBudget`; once the step's
episodes have generated that many tokens or the step has run that long, whichever comes first, every episode
still running pauses at its next turn boundary (the request in flight finishes first, so a pause never splits a
turn) and its state, environment included, is carried to the next step, where it continues under the weights
the engine has then. Peers do the same: verl's `partial_rollout`, slime's `--partial-rollout`, AReaL's
interruptible generation (AReaL interrupts mid-turn; pausing between turns costs at most one turn per episode).

The unit that is trained is the group (its episodes share a baseline), so a group is handed to the trainer only
once all its episodes have finished; its finished episodes wait with it. Every generated token records the policy
version that produced it (`Episode.token_versions` where they differ) and keeps the engine's logprob under that
version, so the update's off-policy correction (TIS / MIS in rl/algos/off_policy.py, rho = pi_old / pi_rollout per
token) compares each token with the policy that actually sampled it.

What this module does not do: sample tasks, train, or bound staleness beyond what the budget implies (an
episode paused k steps in a row has tokens k versions old; `rollout/policy_versions_per_episode_max` shows it).
"""
from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jointrl.records import Task
from rl.log import get_logger
from rl.rollout.agent_loop import (BatchingGenerator, LoopSettings, PausedEpisode, _errored_episode, _Progress,
                                   episode_seed, resume_episode, run_episode)
from rl.rollout.codec import as_codec
from rl.rollout.segments import StepBudget
from rl.types import Episode

log = get_logger("partial")


@dataclass
class _Group:
    """One task's G episodes across steps: finished ones, and paused ones waiting for the next step."""

    task: Task
    episodes: list[Episode | PausedEpisode | None] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(isinstance(e, Episode) for e in self.episodes)


@dataclass(frozen=True)
class PartialStep:
    """What one step's rollout gives: the groups that finished (task, episodes), and its metrics."""

    groups: list[tuple[Task, list[Episode]]]
    metrics: dict[str, float]


class PartialRollouts:
    """Carries paused episodes from one step to the next (one per training run). Not thread-safe."""

    def __init__(self, step_token_budget: int = 0, step_time_budget_s: float = 0.0) -> None:
        if step_token_budget < 0 or step_time_budget_s < 0 or not (step_token_budget > 0 or step_time_budget_s > 0):
            raise ValueError("partial rollouts need step_token_budget >= 1 or step_time_budget_s > 0 (0 = off), got "
                             f"{step_token_budget} and {step_time_budget_s}")
        self.step_token_budget = step_token_budget
        self.step_time_budget_s = step_time_budget_s
        self.pending: list[_Group] = []

    @property
    def paused_episodes(self) -> int:
        return sum(isinstance(e, PausedEpisode) for g in self.pending for e in g.episodes)

    async def step(self, tasks: Sequence[Task], group_size: int, make_env: Callable[[Task], Any], gen: BatchingGenerator,
                   tok: Any, codec: Any, settings: LoopSettings, *, policy_version: int, max_concurrent: int = 32,
                   seed: int = 0) -> PartialStep:
        """Continue the paused episodes and start G episodes of each new task, until the step's budget is spent.
        Returns the groups whose episodes have all finished (carried-over groups first, then new ones in order)."""
        codec = as_codec(codec, tok, end_token_id=settings.end_token_id, special_strings=settings.special_strings)
        t0 = time.monotonic()
        budget = StepBudget(tokens=self.step_token_budget, seconds=self.step_time_budget_s)  # the step's clock starts here
        sem = asyncio.Semaphore(max_concurrent)
        carried = self.pending
        groups = carried + [_Group(task=t, episodes=[None] * group_size) for t in tasks]
        resumed = sum(isinstance(e, PausedEpisode) for g in carried for e in g.episodes)

        async def fresh(gi: int, k: int, ti: int) -> None:
            async with sem:
                task = groups[gi].task
                group_id = f"{task.id}#{policy_version}"
                try:
                    env = make_env(task)
                except Exception as e:  # noqa: BLE001 - like any other failure inside one episode
                    log.error("make_env for %s failed:\n%s", task.id, traceback.format_exc())
                    groups[gi].episodes[k] = _errored_episode(task, _Progress(), e, reward=0.0, group_id=group_id,
                                                              policy_version=policy_version, end_token_id=codec.end_token_id,
                                                              t_start=time.monotonic())
                    return
                groups[gi].episodes[k] = await run_episode(env, task, gen, tok, codec, settings, group_id=group_id,
                                                           policy_version=policy_version, seed=episode_seed(seed, ti, k),
                                                           budget=budget)

        async def resume(gi: int, k: int, paused: PausedEpisode) -> None:
            async with sem:
                groups[gi].episodes[k] = await resume_episode(paused, gen, settings, policy_version=policy_version, budget=budget)

        jobs = []
        for gi, g in enumerate(carried):
            jobs += [resume(gi, k, e) for k, e in enumerate(g.episodes) if isinstance(e, PausedEpisode)]
        for ti in range(len(tasks)):
            jobs += [fresh(len(carried) + ti, k, ti) for k in range(group_size)]
        futures = [asyncio.ensure_future(j) for j in jobs]
        try:
            await asyncio.gather(*futures)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        done = [g for g in groups if g.done]
        self.pending = [g for g in groups if not g.done]
        finished = [e for g in done for e in g.episodes]
        errored = [e for e in finished if isinstance(e, Episode) and e.metrics.get("episode_error")]
        if finished and len(errored) == len(finished) and not self.pending:
            raise RuntimeError(f"all {len(finished)} episodes of the rollout errored; the first: {errored[0].grade_error}")
        metrics = {"rollout/partial_episodes": float(self.paused_episodes), "rollout/resumed_episodes": float(resumed),
                   "rollout/pending_groups": float(len(self.pending)), "rollout/step_tokens": float(budget.spent),
                   "rollout/partial_wall_s": time.monotonic() - t0,
                   # which budget ended the step's generation (both 0: every episode finished within both)
                   "rollout/step_budget_tokens_hit": float(budget.hit == "tokens"),
                   "rollout/step_budget_time_hit": float(budget.hit == "time")}
        return PartialStep(groups=[(g.task, [e for e in g.episodes if isinstance(e, Episode)]) for g in done], metrics=metrics)

    def close(self) -> None:
        """Close the environments of every paused episode (the run ends with them unfinished)."""
        for g in self.pending:
            for e in g.episodes:
                if isinstance(e, PausedEpisode):
                    e.close()
        self.pending = []

