"""The joint multi-domain RL driver: one readable loop.

    sample -> roll out -> grade -> dynamic sampling -> [KL penalty] -> collate -> [critic values]
           -> token-level advantages -> train (at most trainer.max_staleness updates in flight)
           -> sync -> log -> checkpoint

Collaborators (Ray actors for the trainer and rollout workers, environments, tokenizer, chat
codec, metrics sink) are built by `rl.runtime.Runtime` and handed in, so each step below reads as
what it does. The math is in rl/algos (via rl/objective.py); nothing here computes a gradient.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from rl.config import AlgorithmSection, RunConfig
from rl.log import get_logger, progress, setup_logging
from rl.observe.record import RunRecord, write_run_record
from rl.observe.sink import progress_text
from rl.observe.telemetry import time_breakdown
from rl.trainer.batch import TrainBatch
from rl.types import RolloutGroup, StepMetrics

log = get_logger("train")


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
    from rl.algos import zero_variance_groups

    domains = sorted({g.domain for g in groups})
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    gids = torch.tensor([i for i, g in enumerate(groups) for _ in g.episodes], dtype=torch.long)
    dids = torch.tensor([domains.index(g.domain) for g in groups for _ in g.episodes], dtype=torch.long)
    keep_B, _ = zero_variance_groups(rewards, gids, dids, domain_names=dict(enumerate(domains)))
    first = {int(g): i for i, g in reversed(list(enumerate(gids.tolist())))}
    has_signal = [bool(keep_B[first[i]]) for i in range(len(groups))]
    metrics: dict[str, float] = {}
    for d in domains:
        idx = [i for i, g in enumerate(groups) if g.domain == d]
        metrics[f"rollout/zero_var_frac/{d}"] = sum(not has_signal[i] for i in idx) / len(idx)
    if mode == "off":
        return groups, metrics
    kept = [g for g, s in zip(groups, has_signal) if s]
    metrics["rollout/groups_kept"] = float(len(kept))
    return kept, metrics


def oversample(rt, step: int, groups: list[RolloutGroup], want: int, max_tasks: int) -> tuple[list[RolloutGroup], int]:
    """DAPO's dynamic sampling (Yu et al. 2025): roll out more tasks until `want` groups have reward
    variance, drawing at most `max_tasks` tasks in the step. Returns every group rolled out and how
    many extra tasks were drawn; the caller filters."""
    extra, draw = 0, 0
    n_signal = len(dynamic_sampling(groups, "filter")[0])
    while n_signal < want and len(groups) < max_tasks:
        draw += 1
        n = min(want - n_signal, max_tasks - len(groups))
        more, _ = rt.rollout(rt.sampler.sample(n), step, draw=draw)
        groups = groups + more
        extra += n
        n_signal += len(dynamic_sampling(more, "filter")[0])
    return groups, extra


def drain(rt, in_flight: deque, step: int) -> None:
    """Finish every submitted update (logging its metrics at `step`) and sync the engines."""
    while in_flight:
        rt.sink.log(StepMetrics(step=step, values=in_flight.popleft().finish()))
        rt.sync_weights()


def rl_steps(rt, cfg: RunConfig) -> float:
    """The RL loop from `rt.start_step` to `trainer.steps`; returns its wall time in seconds (checkpoint
    saves included, evaluations not; a resumed run adds the time its checkpoint recorded)."""
    bar = progress(range(rt.start_step, cfg.trainer.steps), desc="rl", total=cfg.trainer.steps, initial=rt.start_step)
    t_run = time.perf_counter()
    before = rt.rl_seconds  # RL time of the steps a resumed run already did
    # Submitted updates whose weights the engines do not have yet. Sync mode waits for each at once;
    # async mode lets up to trainer.max_staleness run behind the rollouts, so every trained episode
    # was generated at most that many policy versions earlier.
    in_flight: deque = deque()
    lag = cfg.trainer.max_staleness if cfg.trainer.async_mode else 0
    for step in bar:
        t0 = time.perf_counter()
        tasks = rt.sampler.sample(cfg.trainer.tasks_per_step)             # sample a joint batch across domains
        groups, roll_m = rt.rollout(tasks, step)                           # roll out G episodes per task (graded in-env)
        if cfg.algorithm.dynamic_sampling == "oversample":                 # more tasks until enough groups carry signal
            n = cfg.trainer.tasks_per_step
            groups, roll_m["rollout/oversampled_tasks"] = oversample(rt, step, groups, n, int(n * cfg.algorithm.oversample_factor))
        t_roll = time.perf_counter()
        kept, ds_m = dynamic_sampling(groups, cfg.algorithm.dynamic_sampling)
        rt.sampler.observe(groups)                                         # adaptive weights from the typed groups
        train_m: dict[str, float] = {}
        sync_m: dict[str, float] = {}
        if kept and cfg.algorithm.kl_in_reward:                            # reward -= kl_coef x KL(pi || pi_ref)
            kept, kl_m = rt.penalise_kl(kept)
            ds_m.update(kl_m)
        if kept:
            batch = rt.collate(kept)                                       # one padded token batch, step-wide weights
            values = rt.trainer.values(batch) if rt.has_critic else None    # V(s_t) per generated token (PPO critic)
            batch, adv_m = with_episode_advantages(batch, cfg.algorithm, values)    # token-level advantages (+ GAE returns)
            ds_m.update(adv_m)
            in_flight.append(rt.submit_train(batch, kept))                 # the update (pi_old from its forward), the critic
        while len(in_flight) > lag:                                        # bounded staleness
            train_m = in_flight.popleft().finish()
            sync_m = rt.sync_weights()                                     # push the new weights to the rollout engines
        t_train = time.perf_counter()
        every = cfg.logging.gap_every
        gap_m = rt.measure_gap(groups) if sync_m and every and step % every == 0 else {}   # engine vs trainer, same tokens
        time_m = time_breakdown(groups, step_s=time.perf_counter() - t0, rollout_s=t_roll - t0,
                                train_busy_s=train_m.get("train/busy_s", 0.0), sync_s=sync_m.get("sync/seconds", 0.0))
        values = {**roll_m, **ds_m, **train_m, **sync_m, **gap_m, **time_m,
                  "time/train_and_sync_wait_s": t_train - t_roll, "policy/version": float(rt.policy_version)}
        values.update({f"sampler/weight/{d}": w for d, w in rt.sampler.weights.items()})
        rt.sink.log(StepMetrics(step=step, values=values, samples=rt.samples_for_log(groups)))   # log
        bar.set_postfix_str(progress_text(step, cfg.trainer.steps, values, elapsed_s=time.perf_counter() - t_run,
                                          steps_done=step + 1 - rt.start_step, domains=rt.domains))
        if cfg.trainer.checkpoint_every and (step + 1) % cfg.trainer.checkpoint_every == 0:
            drain(rt, in_flight, step)                                     # a checkpoint holds finished updates
            rt.rl_seconds = before + time.perf_counter() - t_run
            rt.checkpoint(step + 1)                                        # save (model, optimizer, sampler, rng)
    drain(rt, in_flight, cfg.trainer.steps - 1)
    rt.rl_seconds = before + time.perf_counter() - t_run
    rt.checkpoint(cfg.trainer.steps)
    return rt.rl_seconds


SFT_SNAPSHOT = "sft_snapshot"  # RUN_DIR/<this>: trainer state as RL starts, for the SFT control arm


def sft_control(rt, cfg: RunConfig, rl_seconds: float) -> list:
    """The third arm: back to the trainer state RL started from, SFT continued for as long as RL ran, then
    the same held-out evaluation. If it matches RL's gain, the gain was more supervision, not RL."""
    from rl.evaluate import evaluate
    from rl.sft import sft_train

    rt.trainer.load_checkpoint(str(rt.run_dir / SFT_SNAPSHOT))
    rt.refresh_versions()
    m = sft_train(rt, seconds=rl_seconds, label="sft_control", seed_offset=1)
    rt.sync_weights()
    log.info("SFT control: %d supervised steps in %.0f s (RL ran %.0f s)", int(m.get("sft/steps", 0)), m.get("sft/seconds", 0.0), rl_seconds)
    return evaluate(rt, "sft_control")


def run(cfg: RunConfig, runtime=None) -> dict:
    """Train according to `cfg`; returns a summary (before/after eval tables, last metrics)."""
    from rl.eval_plan import write_family_summary
    from rl.evaluate import evaluate, load_eval, print_eval_table
    from rl.runtime import Runtime
    from rl.sft import SFT_META, sft_warm_start

    from rl.log import link_ray_logs

    setup_logging(cfg.logging.level, cfg.resolved_run_dir())  # console at the level, RUN_DIR/logs/ at full detail
    rt = runtime or Runtime.start(cfg)
    link_ray_logs(rt.run_dir)
    try:
        summary: dict = {}
        record = RunRecord.of(rt.env_ids, rt.train_tasks, steps=cfg.trainer.steps)  # the run's domains, families, steps
        write_run_record(rt.run_dir, record)                                   # read by `jointrl report`
        e = cfg.envs
        rt.sampler = rt.sampler.reconfigured(rule=e.sampler_rule, level=e.sampler_level, families=record.family_of(),
                                             dump_c=e.dump_c, dump_temperature=e.dump_temperature)
        snapshot = rt.run_dir / SFT_SNAPSHOT
        if not cfg.trainer.resume:                                             # starting over: no SFT checkpoint is resumed
            (snapshot / SFT_META).unlink(missing_ok=True)
        if rt.start_step == 0 and cfg.trainer.sft_steps > 0:
            # supervised warm start, checkpointed into (and resumed from) the snapshot the control arm starts from
            summary["sft"] = sft_warm_start(rt, cfg.trainer.sft_steps, checkpoint_dir=snapshot)
            rt.sync_weights()
        elif rt.start_step == 0 and cfg.eval.sft_control:
            rt.trainer.save_checkpoint(str(snapshot))                          # the control arm starts here too
        rt.prepare_reference()                                                 # the KL reference, when one is configured
        # A resumed run's policy is a checkpoint of RL, not the one RL started from: the "before" arm is the
        # first run's evaluation (its file), never the checkpoint's.
        before = load_eval(rt.run_dir, "before") if rt.start_step > 0 else None
        if before is not None:
            log.info("resumed at RL step %d: the held-out arm before RL is the first run's (eval_before.json)", rt.start_step)
        else:
            if rt.start_step > 0:
                log.warning("resumed at RL step %d without eval_before.json: the 'before' arm evaluates the checkpoint", rt.start_step)
            before = evaluate(rt, "before")
        summary["before"] = before
        rl_seconds = rl_steps(rt, cfg)                                         # sample -> roll out -> ... -> sync -> log
        summary["rl_seconds"] = rl_seconds
        summary["after"] = evaluate(rt, "after")
        if cfg.eval.sft_control:
            summary["sft_control"] = sft_control(rt, cfg, rl_seconds)
        print_eval_table(rt.run_dir, summary["before"], summary["after"], rt.env_ids, control=summary.get("sft_control"),
                         rl_seconds=rl_seconds, sft=cfg.trainer.sft_steps > 0)
        write_family_summary(rt.run_dir, record.family_of(), cfg.envs.weights, summary["before"], summary["after"])
        return summary
    finally:
        if runtime is None:
            rt.shutdown()


def main(cfg: RunConfig) -> int:
    run(cfg)
    return 0
