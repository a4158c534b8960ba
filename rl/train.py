"""The joint multi-domain RL driver loop: one readable loop.

    sample -> roll out -> grade -> dynamic sampling -> [KL penalty] -> collate -> [critic values]
           -> token-level advantages -> train (at most trainer.max_staleness updates in flight)
           -> sync -> log -> checkpoint

`rl_steps(loop, cfg, state)` runs the steps from `state.step` to `cfg.steps`. Its collaborators (`Loop`:
rollouts, sampler, policy client, weight sync, checkpoints, sink) are built by rl/setup.py and handed in,
so each step below reads as what it does; `LoopConfig` is the few keys the loop reads. Values come back as
typed records (RolloutStats, TrainResult, SyncStats, GapStats) whose fields the loop reads; they become
metric names in their `as_metrics()`. The math is in rl/algos (via rl/objective.py); nothing here computes
a gradient. The run's phases around the loop (SFT, evaluations, the control arm) are rl/run.py.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from rl.checkpoint import DriverState
from rl.log import get_logger, progress
from rl.observe.sink import progress_text
from rl.observe.telemetry import time_breakdown
from rl.trainer.batch import TrainBatch
from rl.types import RolloutGroup, StepMetrics

if TYPE_CHECKING:  # the collaborators' types; tests/rl/test_loop.py hands in fakes of the same shape
    from rl.checkpoint import Checkpoints
    from rl.config import AlgorithmSection
    from rl.observe.sink import MetricsSink
    from rl.rollout.rollouts import Rollouts
    from rl.sampler import DomainSampler
    from rl.sync import WeightSync
    from rl.trainer.client import PolicyClient

log = get_logger("train")


@dataclass(frozen=True)
class LoopConfig:
    """The keys the loop reads."""

    steps: int  # trainer.steps
    tasks_per_step: int  # trainer.tasks_per_step
    lag: int  # updates allowed in flight: trainer.max_staleness in async mode, else 0
    algorithm: AlgorithmSection  # the `algorithm` section (advantages, dynamic sampling, KL in reward)
    checkpoint_every: int = 0  # trainer.checkpoint_every
    gap_every: int = 0  # logging.gap_every
    samples_per_domain: int = 0  # logging.samples_per_domain


@dataclass(frozen=True)
class Loop:
    """The loop's collaborators (rl/setup.py: RunParts has them all)."""

    rollouts: Rollouts  # rollout(tasks, step, draw) -> (groups, RolloutStats); policy_version
    sampler: DomainSampler  # sample(n), observe(groups), weights
    policy: PolicyClient  # penalise_kl, collate, values, submit -> PendingUpdate
    sync: WeightSync  # push() -> SyncStats, gap(groups) -> GapStats | None
    checkpoints: Checkpoints  # save(state, sampler)
    sink: MetricsSink  # log(StepMetrics)
    domains: Sequence[str]


def with_advantages(batch: TrainBatch, a: AlgorithmSection, values_BT: torch.Tensor | None = None
                    ) -> tuple[TrainBatch, dict[str, float]]:
    """Token-level advantages from the registered estimator. Outcome estimators (grpo, dr_grpo, rloo,
    reinforce_pp) spread one return over each episode's generated tokens; `gae` combines it with the
    critic's per-token values, and the GAE returns become the critic's regression targets. The loss's
    advantages are then whitened over the step batch when `algorithm.whiten_advantages` says so
    (rl/objective.py: loss_advantages); the critic's targets keep the raw ones."""
    from rl.algos.advantages import AdvantageInputs, AdvantageParams, compute_advantages, gae_returns_BT
    from rl.objective import loss_advantages

    mask = batch.loss_mask_BT > 0
    inputs = AdvantageInputs(rewards_B=batch.rewards_B, mask_BT=mask, group_ids_B=batch.group_ids_B, values_BT=values_BT)
    raw_BT, m = compute_advantages(a.advantage, inputs, AdvantageParams(norm_std=a.advantage != "dr_grpo", gamma=a.gamma, lam=a.lam))
    raw_BT = torch.where(mask, raw_BT, torch.zeros_like(raw_BT))
    adv_BT, wm = loss_advantages(raw_BT, mask, a.advantage, a.whiten_advantages)
    m.update(wm)
    if values_BT is None:
        return batch.with_(advantages_BT=adv_BT), m
    return batch.with_(advantages_BT=adv_BT, values_BT=values_BT, returns_BT=gae_returns_BT(raw_BT, values_BT, mask)), m


def with_episode_advantages(batch: TrainBatch, a: AlgorithmSection, values_BT: torch.Tensor | None = None
                            ) -> tuple[TrainBatch, dict[str, float]]:
    """`with_advantages` where an episode spans several rows (segments of a compacted history): computed on
    the per-episode layout (rl/trainer/batch.py: EpisodeView), so each episode has one reward and baseline in
    its group and token-level estimators run across its segments, then put back on the rows."""
    from rl.trainer.batch import EpisodeView

    view = EpisodeView.of(batch)
    if view is None:
        return with_advantages(batch, a, values_BT)
    first = view.first_E
    per_episode = batch.with_(loss_mask_BT=view.to_episodes(batch.loss_mask_BT), rewards_B=batch.rewards_B[first],
                              group_ids_B=batch.group_ids_B[first], domain_ids_B=batch.domain_ids_B[first])
    out, m = with_advantages(per_episode, a, None if values_BT is None else view.to_episodes(values_BT))
    rows = {"advantages_BT": view.to_rows(out.advantages_BT)}
    if values_BT is not None:
        rows.update(values_BT=values_BT, returns_BT=view.to_rows(out.returns_BT))
    return batch.with_(**rows), m


def dynamic_sampling(groups: list[RolloutGroup], mode: str) -> tuple[list[RolloutGroup], dict[str, float]]:
    """Drop groups whose samples all got the same reward (no learning signal, per DAPO); report per domain."""
    from rl.algos import group_signal

    signal = group_signal([g.rewards for g in groups], [g.domain for g in groups])
    metrics = signal.metrics()  # rollout/zero_var_frac/<domain>
    if mode == "off":
        return groups, metrics
    kept = [g for g, s in zip(groups, signal.has_signal_G) if s]
    metrics["rollout/groups_kept"] = float(len(kept))
    return kept, metrics


def oversample(rollouts: Rollouts, sampler: DomainSampler, step: int, groups: list[RolloutGroup], want: int,
               max_tasks: int) -> tuple[list[RolloutGroup], int]:
    """DAPO's dynamic sampling (Yu et al. 2025): roll out more tasks until `want` groups have reward
    variance, drawing at most `max_tasks` tasks in the step. Returns every group rolled out and how
    many extra tasks were drawn; the caller filters."""
    extra, draw = 0, 0
    n_signal = len(dynamic_sampling(groups, "filter")[0])
    while n_signal < want and len(groups) < max_tasks:
        draw += 1
        n = min(want - n_signal, max_tasks - len(groups))
        more, _ = rollouts.rollout(sampler.sample(n), step, draw=draw)
        groups = groups + more
        extra += n
        n_signal += len(dynamic_sampling(more, "filter")[0])
    return groups, extra


def samples_for_log(groups: Sequence[RolloutGroup], tok: Any, domains: Sequence[str], per: int) -> list[dict[str, str]]:
    """Up to `per` transcripts per domain for the sink's sample table."""
    out = []
    for d in domains:
        for e in [e for g in groups if g.domain == d for e in g.episodes][:per]:
            text = tok.decode(list(e.token_ids), skip_special_tokens=False)
            out.append({"domain": d, "task_id": e.task_id, "reward": f"{e.reward:.3f}", "turns": str(e.num_turns),
                        "transcript": text[-4000:]})
    return out


def drain(loop: Loop, in_flight: deque, step: int) -> None:
    """Finish every submitted update (logging its metrics at `step`) and sync the engines."""
    while in_flight:
        loop.sink.log(StepMetrics(step=step, values=in_flight.popleft().finish().as_metrics()))
        loop.sync.push()


def rl_steps(loop: Loop, cfg: LoopConfig, state: DriverState) -> DriverState:
    """The RL loop from `state.step` to `cfg.steps`; returns the state after the last step, whose `rl_seconds`
    is the loop's wall time (checkpoint saves included, evaluations not; a resumed run adds the time its
    checkpoint recorded)."""
    a = cfg.algorithm
    bar = progress(range(state.step, cfg.steps), desc="rl", total=cfg.steps, initial=state.step)
    t_run = time.perf_counter()
    start, before = state.step, state.rl_seconds  # RL time of the steps a resumed run already did
    # Submitted updates whose weights the engines do not have yet. Sync mode waits for each at once;
    # async mode lets up to trainer.max_staleness run behind the rollouts, so every trained episode
    # was generated at most that many policy versions earlier.
    in_flight: deque = deque()
    for step in bar:
        t0 = time.perf_counter()
        tasks = loop.sampler.sample(cfg.tasks_per_step)                    # sample a joint batch across domains
        groups, roll = loop.rollouts.rollout(tasks, step)                  # roll out G episodes per task (graded in-env)
        if a.dynamic_sampling == "oversample":                             # more tasks until enough groups carry signal
            n = cfg.tasks_per_step
            groups, extra = oversample(loop.rollouts, loop.sampler, step, groups, n, int(n * a.oversample_factor))
            roll = replace(roll, oversampled_tasks=extra)
        t_roll = time.perf_counter()
        kept, ds_m = dynamic_sampling(groups, a.dynamic_sampling)
        loop.sampler.observe(groups)                                       # adaptive weights from the typed groups
        trained = synced = gap = None
        if kept and a.kl_in_reward:                                        # reward -= kl_coef x KL(pi || pi_ref)
            kept, kl_m = loop.policy.penalise_kl(kept)
            ds_m.update(kl_m)
        if kept:
            batch = loop.policy.collate(kept)                              # one padded token batch, step-wide weights
            values = loop.policy.values(batch)                             # V(s_t) per generated token (PPO critic) or None
            batch, adv_m = with_episode_advantages(batch, a, values)       # token-level advantages (+ GAE returns)
            ds_m.update(adv_m)
            in_flight.append(loop.policy.submit(batch, kept))              # the update (pi_old from its forward), the critic
        while len(in_flight) > cfg.lag:                                    # bounded staleness
            trained = in_flight.popleft().finish()
            synced = loop.sync.push()                                      # push the new weights to the rollout engines
        t_train = time.perf_counter()
        if synced is not None and cfg.gap_every and step % cfg.gap_every == 0:
            gap = loop.sync.gap(groups)                                    # engine vs trainer, same tokens
        time_m = time_breakdown(groups, step_s=time.perf_counter() - t0, rollout_s=t_roll - t0,
                                train_busy_s=(trained.busy_s or 0.0) if trained is not None else 0.0,
                                sync_s=synced.seconds if synced is not None else 0.0)
        values = {**roll.as_metrics(), **ds_m, **_metrics(trained), **_metrics(synced), **_metrics(gap), **time_m,
                  "time/train_and_sync_wait_s": t_train - t_roll, "policy/version": float(loop.rollouts.policy_version)}
        values.update({f"sampler/weight/{d}": w for d, w in loop.sampler.weights.items()})
        samples = samples_for_log(groups, loop.rollouts.tok, loop.domains, cfg.samples_per_domain)
        loop.sink.log(StepMetrics(step=step, values=values, samples=samples))    # log
        bar.set_postfix_str(progress_text(step, cfg.steps, values, elapsed_s=time.perf_counter() - t_run,
                                          steps_done=step + 1 - start, domains=loop.domains))
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            drain(loop, in_flight, step)                                   # a checkpoint holds finished updates
            state = DriverState(step=step + 1, policy_version=loop.rollouts.policy_version,
                                rl_seconds=before + time.perf_counter() - t_run)
            loop.checkpoints.save(state, loop.sampler)                     # save (model, optimizer, sampler, rng)
    drain(loop, in_flight, cfg.steps - 1)
    state = DriverState(step=cfg.steps, policy_version=loop.rollouts.policy_version, rl_seconds=before + time.perf_counter() - t_run)
    loop.checkpoints.save(state, loop.sampler)
    return state


def _metrics(record: Any) -> Mapping[str, float]:
    return record.as_metrics() if record is not None else {}
