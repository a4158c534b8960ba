"""A run's rollouts: G episodes per task through the rollout dispatcher, as typed groups and statistics.

`Rollouts` holds the dispatcher (the vLLM workers), the task pools' environment factory, the chat codec and
the agent loop's settings. `rollout(tasks, step)` is one driver step's rollout (seeded from the run seed and
the step, so a resumed run replays it; partial rollouts when `rollout.partial` is on); `run_groups` runs
episodes at a given temperature (the held-out evaluation). `policy_version` is the version the engines
serve, stamped on every episode; the weight sync (rl/sync.py) advances it.

It does not sample tasks, train, or sync weights.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Sequence

from jointrl.records import Task
from rl.types import Episode, RolloutGroup, RolloutStats


class Rollouts:
    def __init__(self, engine: Any, make_env: Callable[[Task], Any], codec: Any, settings: Any, *, group_size: int,
                 seed: int, max_concurrent: int, partial: bool = False, step_token_budget: int = 0, step_time_budget_s: float = 0.0,
                 think_ids: tuple[int, int] | None = None, policy_version: int = 0) -> None:
        self.engine = engine  # rl.rollout.dispatcher.RolloutDispatcher (or a stand-in with `generate`)
        self._make_env = make_env
        self.codec = codec
        self.tok = codec.tokenizer
        self.settings = settings  # rl.rollout.agent_loop.LoopSettings at rollout.temperature
        self.group_size = group_size
        self.seed = seed  # envs.seed: rollout seeds derive from it and the step
        self.max_concurrent = max_concurrent
        self.partial = partial
        self.step_token_budget = step_token_budget
        self.step_time_budget_s = step_time_budget_s
        self.think_ids = think_ids  # None: the format has no thinking block to count
        self.policy_version = policy_version
        self._partial: Any = None

    def make_env(self, task: Task) -> Any:
        return self._make_env(task)

    def loop_settings(self, temperature: float | None = None) -> Any:
        return self.settings if temperature is None else dataclasses.replace(self.settings, temperature=temperature)

    def run_groups(self, tasks: Sequence[Task], group_size: int, temperature: float | None = None, seed: int = 0) -> list[list[Episode]]:
        from rl.rollout.agent_loop import BatchingGenerator, ThreadedGenerate, run_groups

        async def go():
            # The dispatcher blocks on Ray: each batch waits in a thread of its own, so every waiting episode's
            # request reaches the continuously batching engine at once.
            async with ThreadedGenerate(self.engine.generate, self.max_concurrent) as generate_batch:
                gen = BatchingGenerator(generate_batch)
                return await run_groups(tasks, group_size, self.make_env, gen, self.tok, self.codec, self.loop_settings(temperature),
                                        policy_version=self.policy_version, max_concurrent=self.max_concurrent, seed=seed)

        return asyncio.run(go())

    def run_partial(self, tasks: Sequence[Task], group_size: int, seed: int = 0):
        """One step of partial rollouts: ([(task, episodes)] of the groups that finished, metrics); the episodes
        still running when rollout.step_token_budget or rollout.step_time_budget_s is spent continue in the next call."""
        from rl.rollout.agent_loop import BatchingGenerator, ThreadedGenerate
        from rl.rollout.partial import PartialRollouts

        if self._partial is None:
            self._partial = PartialRollouts(self.step_token_budget, self.step_time_budget_s)

        async def go():
            async with ThreadedGenerate(self.engine.generate, self.max_concurrent) as generate_batch:
                return await self._partial.step(tasks, group_size, self.make_env, BatchingGenerator(generate_batch), self.tok,
                                                self.codec, self.loop_settings(), policy_version=self.policy_version,
                                                max_concurrent=self.max_concurrent, seed=seed)

        out = asyncio.run(go())
        return out.groups, out.metrics

    def rollout(self, tasks: Sequence[Task], step: int, draw: int = 0) -> tuple[list[RolloutGroup], RolloutStats]:
        """G episodes per task. Sampling seeds depend on (run seed, step, draw, task, sample, turn) only,
        so a run resumed at `step` replays what an uninterrupted run would (docs/rollout.md,
        Determinism); `draw` numbers the extra rollouts of one step (oversampling)."""
        from rl.observe.telemetry import rollout_metrics
        from rl.rollout.agent_loop import derive_seed, rollout_seed

        t0 = time.perf_counter()
        G = self.group_size
        seed = rollout_seed(self.seed, step)
        partial_m: dict[str, float] = {}
        if self.partial:  # a step bounded by rollout.step_token_budget / step_time_budget_s (rl/rollout/partial.py)
            done, partial_m = self.run_partial(tasks, G, seed=seed if draw == 0 else derive_seed(seed, draw))
            tasks, eps = [t for t, _ in done], [e for _, e in done]  # the groups that finished, carried-over ones first
        else:
            eps = self.run_groups(tasks, G, seed=seed if draw == 0 else derive_seed(seed, draw))
        groups = [RolloutGroup(task_id=t.id, domain=t.domain, episodes=tuple(e)) for t, e in zip(tasks, eps)]
        m = rollout_metrics(groups, self.think_ids, policy_version=self.policy_version)
        m.update(partial_m)
        rate = sum(len(g.episodes) for g in groups) / max(time.perf_counter() - t0, 1e-9)
        return groups, RolloutStats(per_domain=m, episodes_per_s=rate)

    def close(self) -> None:
        """Close the paused partial episodes' environments (sandboxes)."""
        if self._partial is not None:
            self._partial.close()
