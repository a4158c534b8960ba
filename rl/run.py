"""A training run's phases, in order: the run record, the SFT warm start (or the control arm's snapshot), the
KL reference, the held-out evaluation before RL, the RL steps (rl/train.py), the evaluation after, the SFT
control arm, the tables.

`run(cfg)` starts the parts (rl/setup.py), runs the phases and shuts the parts down; `run(cfg, parts)` runs
the phases on parts a caller started (and shuts down itself). It does not run a step of RL itself.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from rl.config import RunConfig
from rl.log import get_logger, setup_logging
from rl.train import Loop, LoopConfig, rl_steps

log = get_logger("run")

SFT_SNAPSHOT = "sft_snapshot"  # RUN_DIR/<this>: trainer state as RL starts, for the SFT control arm


def loop_config(cfg: RunConfig) -> LoopConfig:
    t = cfg.trainer
    return LoopConfig(steps=t.steps, tasks_per_step=t.tasks_per_step, lag=t.max_staleness if t.async_mode else 0,
                      algorithm=cfg.algorithm, checkpoint_every=t.checkpoint_every, gap_every=cfg.logging.gap_every,
                      samples_per_domain=cfg.logging.samples_per_domain)


def evaluate_parts(parts: Any, cfg: RunConfig, label: str) -> list:
    """The held-out evaluation `label` of the parts' policy (as the engines serve it)."""
    from rl.evaluate import evaluate

    return evaluate(parts.rollouts, parts.pools, cfg.eval, parts.run_dir, label, default_n=max(2, cfg.trainer.tasks_per_step),
                    weights=cfg.envs.weights)


def sft_control(parts: Any, cfg: RunConfig, rl_seconds: float) -> list:
    """The third arm: back to the trainer state RL started from, SFT continued for as long as RL ran, then
    the same held-out evaluation. If it matches RL's gain, the gain was more supervision, not RL."""
    from rl.sft import sft_train

    parts.policy.load_checkpoint(str(parts.run_dir / SFT_SNAPSHOT))
    parts.rollouts.policy_version = parts.policy.refresh_versions()
    stats = sft_train(parts.policy, parts.sft.episodes(parts.rollouts), cfg.trainer, parts.run_dir, seed=cfg.model.seed,
                      seconds=rl_seconds, label="sft_control", seed_offset=1)
    parts.sync.push()
    log.info("SFT control: %d supervised steps in %.0f s (RL ran %.0f s)", stats.steps, stats.seconds, rl_seconds)
    return evaluate_parts(parts, cfg, "sft_control")


def run(cfg: RunConfig, parts: Any = None) -> dict:
    """Train according to `cfg`; returns a summary (before/after eval tables, RL seconds, SFT metrics)."""
    from rl.setup import start_run

    setup_logging(cfg.logging.level, cfg.resolved_run_dir())  # console at the level, RUN_DIR/logs/ at full detail
    own = parts is None
    parts = parts or start_run(cfg)
    try:
        return _phases(parts, cfg)
    finally:
        if own:
            parts.close()


def _phases(parts: Any, cfg: RunConfig) -> dict:
    from rl.eval_plan import write_family_summary
    from rl.evaluate import load_eval, print_eval_table
    from rl.log import link_ray_logs
    from rl.observe.record import RunRecord, write_run_record
    from rl.sft import SFT_META, sft_warm_start

    link_ray_logs(parts.run_dir)
    summary: dict = {}
    pools, state = parts.pools, parts.state
    record = RunRecord.of(pools.env_ids, pools.train, steps=cfg.trainer.steps)  # the run's domains, families, steps
    write_run_record(parts.run_dir, record)                                      # read by `jointrl report`
    e = cfg.envs
    sampler = parts.sampler.reconfigured(rule=e.sampler_rule, level=e.sampler_level, families=record.family_of(),
                                         dump_c=e.dump_c, dump_temperature=e.dump_temperature)
    snapshot = parts.run_dir / SFT_SNAPSHOT
    if not cfg.trainer.resume:                                                   # starting over: no SFT checkpoint is resumed
        (snapshot / SFT_META).unlink(missing_ok=True)
    if state.step == 0 and cfg.trainer.sft_steps > 0:
        # supervised warm start, checkpointed into (and resumed from) the snapshot the control arm starts from
        stats = sft_warm_start(parts.policy, parts.sft.episodes(parts.rollouts), cfg.trainer, parts.run_dir,
                               seed=cfg.model.seed, steps=cfg.trainer.sft_steps, checkpoint_dir=snapshot)
        parts.rollouts.policy_version = parts.policy.refresh_versions()
        summary["sft"] = stats.as_metrics()
        parts.sync.push()
    elif state.step == 0 and cfg.eval.sft_control:
        parts.policy.save_checkpoint(str(snapshot))                              # the control arm starts here too
    parts.policy.prepare_reference(parts.rollouts.policy_version)                # the KL reference, when one is configured
    # A resumed run's policy is a checkpoint of RL, not the one RL started from: the "before" arm is the
    # first run's evaluation (its file), never the checkpoint's.
    before = load_eval(parts.run_dir, "before") if state.step > 0 else None
    if before is not None:
        log.info("resumed at RL step %d: the held-out arm before RL is the first run's (eval_before.json)", state.step)
    else:
        if state.step > 0:
            log.warning("resumed at RL step %d without eval_before.json: the 'before' arm evaluates the checkpoint", state.step)
        before = evaluate_parts(parts, cfg, "before")
    summary["before"] = before
    loop = Loop(rollouts=parts.rollouts, sampler=sampler, policy=parts.policy, sync=parts.sync,
                checkpoints=parts.checkpoints, sink=parts.sink, domains=pools.domains)
    state = rl_steps(loop, loop_config(cfg), replace(state, policy_version=parts.rollouts.policy_version))
    summary["rl_seconds"] = state.rl_seconds
    summary["after"] = evaluate_parts(parts, cfg, "after")
    if cfg.eval.sft_control:
        summary["sft_control"] = sft_control(parts, cfg, state.rl_seconds)
    print_eval_table(parts.run_dir, summary["before"], summary["after"], pools.env_ids, control=summary.get("sft_control"),
                     rl_seconds=state.rl_seconds, sft=cfg.trainer.sft_steps > 0)
    write_family_summary(parts.run_dir, record.family_of(), cfg.envs.weights, summary["before"], summary["after"])
    return summary


def main(cfg: RunConfig) -> int:
    run(cfg)
    return 0
