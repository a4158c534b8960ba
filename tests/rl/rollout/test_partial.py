"""Partial rollouts (rl/rollout/partial.py): a step ends when its token or time budget is spent, paused episodes continue in
a later step under newer weights, every token keeps the version that generated it, and the TIS weights of the
update compare each token with that version's logprob.

The engine double plays the long-horizon rung's reference (tests/rl/rollout/rollout_helpers.py: TrailPolicy) and
reports logprobs that depend on its current "weights version", as a real engine's would after a sync; the env,
codec, agent loop, scheduler, collation and the TIS function are the real ones.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import pytest
import torch

import envs
from rl.algos.off_policy import truncated_is_weights
from rl.rollout.agent_loop import BatchingGenerator, LoopSettings
from rl.rollout.codec import make_codec
from rl.rollout.context import ContextSettings
from rl.rollout.engine import GenerateResult
from rl.rollout.partial import PartialRollouts
from rl.rollout.segments import StepBudget
from rl.trainer.batch import collate
from rl.types import Episode, RolloutGroup, segments_of
from tests.rl.rollout.rollout_helpers import LONG_ENV as ENV
from tests.rl.rollout.rollout_helpers import TrailPolicy
from tests.rl.rollout.rollout_helpers import long_task as _task

LP = {0: -0.5, 1: -0.1, 2: -0.3}  # the logprob every token gets under weights version v


class VersionedPolicy:
    """One TrailPolicy per episode (told apart by the task text in the prompt); logprobs from `LP[version]`."""

    def __init__(self, codec, tasks, delay_s: float = 0.0):
        self.codec = codec
        self.by_task = {t.prompt[1].content: TrailPolicy(codec, t) for t in tasks}
        self.version = 0
        self.requests = 0
        self.delay_s = delay_s  # wall time of one engine call (a batch of waiting requests), as a real engine takes

    async def __call__(self, reqs):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = []
        for r in reqs:
            text = self.codec.tokenizer.decode(list(r.prompt_token_ids[:900]), skip_special_tokens=False)
            pol = next(p for k, p in self.by_task.items() if k in text)
            (res,) = await pol([r])
            out.append(dataclasses.replace(res, logprobs=tuple(LP[self.version] for _ in res.token_ids)))
        self.requests += len(reqs)
        return out


def _step(pr, tasks, pol, codec, version, strategy="full"):
    pol.version = version
    settings = LoopSettings(max_model_len=8192, max_new_tokens_per_turn=96, max_turns=40, end_token_id=codec.end_token_id,
                            context=ContextSettings(strategy=strategy))
    return asyncio.run(pr.step(tasks, 1, lambda t: envs.make(ENV), BatchingGenerator(pol), codec.tokenizer, codec, settings,
                               policy_version=version, seed=7))


@pytest.mark.parametrize("strategy", ["full", "window"])
def test_a_paused_episode_finishes_later_with_two_versions_and_tis_uses_each_tokens_own(strategy):
    codec = make_codec("jointrl", None)
    tasks = [_task(0), _task(1)]
    pol = VersionedPolicy(codec, tasks)
    pr = PartialRollouts(step_token_budget=400)  # about half of an episode's generated tokens
    first = _step(pr, tasks, pol, codec, 0, strategy)
    assert first.groups == [] and first.metrics["rollout/partial_episodes"] == 2.0
    assert 400 <= first.metrics["rollout/step_tokens"] < 400 + 2 * 96  # at most one turn per episode past the budget
    done: list[Episode] = []
    for version in (1, 2, 2, 2, 2):
        out = _step(pr, [], pol, codec, version, strategy)
        done += [e for _, eps in out.groups for e in eps]
        if not pr.pending:
            break
    assert len(done) == 2 and all(e.reward == 1.0 for e in done) and not pr.pending
    for e in done:
        assert e.policy_version == 0 and e.metrics["policy_versions"] >= 2
        seen: set[int] = set()
        for s in segments_of(e):
            assert len(s.token_versions) == len(s.token_ids)
            for m, v, lp in zip(s.loss_mask, s.token_versions, s.rollout_logprobs):
                if m:
                    seen.add(v)
                    assert lp == pytest.approx(LP[v])  # each token keeps the logprob of the weights that sampled it
                else:
                    assert lp == 0.0
        assert {0, 1} <= seen
    from rl.observe.telemetry import rollout_metrics

    m = rollout_metrics([RolloutGroup(task_id=e.task_id, domain=e.domain, episodes=(e,)) for e in done])
    assert m["rollout/policy_versions_per_episode_max"] >= 2
    # The update's TIS: rho_t = pi_old / pi_rollout per token, against the version that generated token t.
    batch = collate(done, [1.0, 1.0])
    old_BT = torch.full_like(batch.rollout_logprobs_BT, -0.3) * batch.loss_mask_BT
    w_BT, _ = truncated_is_weights(old_BT, batch.rollout_logprobs_BT, batch.loss_mask_BT > 0, cap=2.0)
    rows = [s for e in done for s in segments_of(e)]
    for b, s in enumerate(rows):
        for t, (m, v) in enumerate(zip(s.loss_mask, s.token_versions)):
            if m and t > 0:
                assert float(w_BT[b, t]) == pytest.approx(min(math.exp(-0.3 - LP[v]), 2.0), rel=1e-5)


def test_a_step_with_one_long_episode_ends_when_the_short_ones_are_done():
    """Seven 3-turn episodes and one 30-turn one: with a budget of about the short ones' tokens, the step makes
    a few engine rounds instead of thirty, and the long one finishes in later steps."""
    codec = make_codec("jointrl", None)
    tasks = [dataclasses.replace(_task(i), limits=dataclasses.replace(_task(i).limits, max_turns=30 if i == 0 else 3))
             for i in range(8)]
    pol = VersionedPolicy(codec, tasks)
    per_turn = 30  # the reference's read_log call is ~25-35 tokens in the project format
    pr = PartialRollouts(step_token_budget=7 * 3 * per_turn)
    out = _step(pr, tasks, pol, codec, 0)
    assert len(out.groups) == 7 and pr.paused_episodes == 1  # the seven short groups train now
    rounds_partial = pol.requests
    steps = 1
    while pr.pending:
        _step(pr, [], pol, codec, steps)
        steps += 1
    assert 2 <= steps <= 6
    pol2 = VersionedPolicy(codec, tasks)
    from rl.rollout.agent_loop import run_groups

    settings = LoopSettings(max_model_len=8192, max_new_tokens_per_turn=96, max_turns=None, end_token_id=codec.end_token_id)
    asyncio.run(run_groups(tasks, 1, lambda t: envs.make(ENV), BatchingGenerator(pol2), codec.tokenizer, codec, settings))
    long_turns = min(30, len(envs.make(ENV).reference(tasks[0])))  # the reference submits after its trail
    assert long_turns >= 21
    # the step without partial waits for every turn of the long episode; with partial it stops a few turns past the short ones
    assert pol2.requests == 7 * 3 + long_turns and rounds_partial < 7 * 3 + 8


def test_a_time_budget_ends_the_step_at_about_its_length_and_the_long_episode_goes_on_under_new_weights():
    """rollout.step_time_budget_s alone (no token budget): seven 3-turn episodes and one of 21+ turns, on an engine
    whose every call takes 0.1 s, so the step without a budget lasts >= 2.1 s (the long episode's calls one after
    another). With a 0.6 s budget the step returns at about 0.6 s, the short groups trained and the long episode
    paused; it finishes in later steps, its tokens from at least two policy versions, each with its own logprob."""
    codec = make_codec("jointrl", None)
    tasks = [dataclasses.replace(_task(i), limits=dataclasses.replace(_task(i).limits, max_turns=30 if i == 0 else 3))
             for i in range(8)]
    delay, seconds = 0.1, 0.6
    long_turns = min(30, len(envs.make(ENV).reference(tasks[0])))
    assert long_turns * delay >= 2.1  # what the step would take without a budget
    pol = VersionedPolicy(codec, tasks, delay_s=delay)
    pr = PartialRollouts(step_time_budget_s=seconds)
    t0 = time.monotonic()
    out = _step(pr, tasks, pol, codec, 0)
    wall = time.monotonic() - t0
    assert len(out.groups) == 7 and pr.paused_episodes == 1
    assert out.metrics["rollout/step_budget_time_hit"] == 1.0 and out.metrics["rollout/step_budget_tokens_hit"] == 0.0
    # at least the budget (episodes were still running), at most about one engine call past it (plus this shared
    # machine's scheduling slack), and well short of the 2.1 s the long episode alone needs
    assert seconds <= out.metrics["rollout/partial_wall_s"] <= wall < seconds + 0.9  # ~0.63-0.75 s measured
    first_calls = pol.requests
    assert first_calls < 7 * 3 + long_turns
    steps = [out]
    for version in [1] + [2] * 10:  # LP's versions
        steps.append(_step(pr, [], pol, codec, version))
        if not pr.pending:
            break
    assert not pr.pending and 3 <= len(steps) <= 8  # ~6 engine calls a step for ~25 calls
    (long_ep,) = [e for _, eps in steps[-1].groups for e in eps]
    assert long_ep.reward == 1.0 and long_ep.task_id == tasks[0].id and long_ep.metrics["policy_versions"] >= 2
    gen = [(v, lp) for s in segments_of(long_ep) for m, v, lp in zip(s.loss_mask, s.token_versions, s.rollout_logprobs) if m]
    assert {0, 1} <= {v for v, _ in gen} and all(lp == pytest.approx(LP[v]) for v, lp in gen)


def test_the_token_and_time_budgets_end_a_step_whichever_is_spent_first():
    """StepBudget with both budgets (a clock under the test's control): the first one spent is the one reported,
    and it stays the reason; 0 turns a budget off; with both off there is no budget at all."""
    now = [100.0]
    b = StepBudget(tokens=50, seconds=2.0, clock=lambda: now[0])
    b.spent = 49
    now[0] = 101.9
    assert not b.exhausted and b.hit is None
    now[0] = 102.0
    assert b.exhausted and b.hit == "time"
    b.spent = 50
    assert b.hit == "time"
    c = StepBudget(tokens=50, seconds=2.0, clock=lambda: now[0])
    c.spent = 50
    assert c.exhausted and c.hit == "tokens"
    d = StepBudget(tokens=50, clock=lambda: now[0])  # time off
    now[0] = 1e9
    assert not d.exhausted
    e = StepBudget(seconds=2.0, clock=lambda: now[0])  # tokens off
    e.spent = 10**9
    assert not e.exhausted
    for bad in [dict(), dict(tokens=0, seconds=0.0), dict(tokens=-1, seconds=1.0), dict(tokens=5, seconds=-1.0)]:
        with pytest.raises(ValueError, match="tokens >= 1 or seconds > 0"):
            StepBudget(**bad)
    with pytest.raises(ValueError, match="step_token_budget >= 1 or step_time_budget_s > 0"):
        PartialRollouts()


def test_step_time_budget_s_is_checked_before_anything_starts():
    """rollout.step_time_budget_s: null or 0 is off; a positive number needs rollout.partial on; a partial run needs
    one of the two budgets; the errors name the key and what is allowed."""
    from rl.config import ConfigError, load_config

    assert load_config(None, []).rollout.step_time_budget_s is None
    cfg = load_config(None, ["rollout.partial=on", "rollout.step_time_budget_s=2.5"])
    assert (cfg.rollout.step_time_budget_s, cfg.rollout.step_token_budget) == (2.5, 0)
    assert load_config(None, ["rollout.partial=on", "rollout.step_time_budget_s=0", "rollout.step_token_budget=10"])
    for overrides, needle in [
        (["rollout.step_time_budget_s=3"], "'rollout.step_time_budget_s': 3.0 is read only with rollout.partial: on"),
        (["rollout.partial=on", "rollout.step_time_budget_s=-1"], "'rollout.step_time_budget_s': -1.0 is not allowed; allowed values: null or 0"),
        (["rollout.partial=on", "rollout.step_time_budget_s=.inf"], "'rollout.step_time_budget_s'"),
        (["rollout.partial=on"], "rollout.step_token_budget > 0 (generated tokens per step, got 0) or rollout.step_time_budget_s > 0"),
        (["rollout.partial=on", "rollout.step_time_budget_s=fast"], "'rollout.step_time_budget_s'"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert needle in str(err.value), (overrides, str(err.value))


def test_rollout_step_time_budget_s_bounds_a_rollouts_step():
    """rollout.step_time_budget_s, passed as start_run passes it, makes Rollouts.rollout stop at the time budget: two
    long episodes on an engine whose calls take 0.1 s pause after about 0.5 s and say the time budget ended the step."""
    from rl.config import load_config
    from rl.rollout.rollouts import Rollouts
    from rl.setup import loop_settings_for

    codec = make_codec("jointrl", None)
    tasks = [_task(0), _task(1)]
    pol = VersionedPolicy(codec, tasks, delay_s=0.1)

    class Engine:  # the dispatcher's blocking generate
        def generate(self, reqs):
            return asyncio.run(pol(list(reqs)))

    cfg = load_config(None, ["rollout.partial=on", "rollout.step_time_budget_s=0.5", "algorithm.group_size=1", "envs.max_turns=40",
                             "rollout.max_model_len=8192"])
    r = cfg.rollout
    rollouts = Rollouts(Engine(), lambda t: envs.make(ENV), codec, loop_settings_for(cfg, codec), group_size=1, seed=0,
                        max_concurrent=r.max_concurrent_episodes, partial=r.partial == "on", step_token_budget=r.step_token_budget,
                        step_time_budget_s=r.step_time_budget_s or 0.0)
    groups, stats = rollouts.rollout(tasks, step=0)
    m = stats.as_metrics()
    assert groups == [] and m["rollout/partial_episodes"] == 2.0 and m["rollout/step_budget_time_hit"] == 1.0
    assert 0.5 <= m["rollout/partial_wall_s"] < 1.4 and pol.requests < 2 * 20  # >= 2 s without the budget
    rollouts.close()


def test_config_keys_reach_the_loop_and_the_rollouts_roll_out_partially():
    """rollout.context* become the loop's ContextSettings; rollout.partial / step_token_budget make Rollouts.rollout
    carry unfinished episodes to the next call (Rollouts without Ray: the engine is the trail-playing double)."""
    import envs
    from rl.config import load_config
    from rl.rollout.rollouts import Rollouts
    from rl.setup import loop_settings_for

    codec = make_codec("jointrl", None)
    cfg = load_config(None, ["rollout.context=window", "rollout.context_keep_turns=2", "rollout.context_budget_tokens=900",
                             "rollout.context_domains={terminal: summarize}", "rollout.partial=on", "rollout.step_token_budget=300",
                             "rollout.max_model_len=2048", "algorithm.group_size=1", "envs.max_turns=40"])
    s = loop_settings_for(cfg, codec)
    assert (s.context.strategy, s.context.keep_turns, s.context.budget_tokens) == ("window", 2, 900)
    assert s.context.strategy_for("terminal") == "summarize" and s.context.strategy_for("swe") == "window"
    tasks = [_task(0), _task(1)]
    pol = VersionedPolicy(codec, tasks)

    class Engine:  # the dispatcher's blocking generate
        def generate(self, reqs):
            return asyncio.run(pol(list(reqs)))

    cfg = load_config(None, ["rollout.context=full", "rollout.partial=on", "rollout.step_token_budget=300",
                             "algorithm.group_size=1", "envs.max_turns=40", "rollout.max_model_len=8192"])
    r = cfg.rollout
    rollouts = Rollouts(Engine(), lambda t: envs.make(ENV), codec, loop_settings_for(cfg, codec), group_size=cfg.algorithm.group_size,
                  seed=cfg.envs.seed, max_concurrent=r.max_concurrent_episodes, partial=r.partial == "on",
                  step_token_budget=r.step_token_budget)
    groups, stats = rollouts.rollout(tasks, step=0)
    m = stats.as_metrics()
    assert groups == [] and m["rollout/partial_episodes"] == 2.0
    finished, most = [], 0.0
    for step in range(1, 16):
        rollouts.policy_version = step
        pol.version = min(step, 2)
        groups, stats = rollouts.rollout([], step=step)
        m = stats.as_metrics()
        finished += groups
        most = max(most, m.get("rollout/policy_versions_per_episode_max", 0.0))
        if len(finished) == 2:
            break
    assert {g.task_id for g in finished} == {t.id for t in tasks} and most >= 2
    assert all(e.reward == 1.0 for g in finished for e in g.episodes) and m["rollout/partial_episodes"] == 0.0
