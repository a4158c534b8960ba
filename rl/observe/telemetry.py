"""Per-domain rollout and policy metrics: what each step's episodes (and the trainer's view of them) looked like.

Pure functions; names follow `<family>/<stat>/<domain>` so dashboards can group them (`reward/mean/swe`).
  * `rollout_metrics(groups, think_ids)`: from `RolloutGroup`s — reward mean/std, success rate, token / thinking-token /
    turn means and their distribution quantiles (min, p10, p25, p50, p75, p90, max: the report draws box plots
    from them, since metrics.jsonl holds scalars only), truncation, wall time, grading errors, tool-call error
    rates, sandbox counters the environments report, and policy staleness.
  * `logprob_gap_metrics(...)`: per-domain train/inference gap — the trainer's and the engine's logprobs of the
    same generated tokens.
  * `ratio_metrics(...)`: per-domain token-level clip fractions of the PPO ratio and the sampled-token
    negative logprob (an entropy estimate at temperature 1).
What it does not do: MoE router statistics (rl/observe/moe.py), losses (the objective reports those),
logging (rl/observe/sink.py). The name scheme is rl/observe/names.py.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np
import torch

from rl.observe.names import per_domain
from rl.types import Episode, RolloutGroup, segments_of

# Quantiles written for each distribution (name suffix, q); the report's box plots use min/p25/p50/p75/max.
QUANTILES: tuple[tuple[str, float], ...] = (("min", 0.0), ("p10", 0.1), ("p25", 0.25), ("p50", 0.5),
                                            ("p75", 0.75), ("p90", 0.9), ("max", 1.0))
# Episode.metrics keys (from envs/base.py's Grade metrics) averaged per domain as `episode/<key>_mean/<d>`.
_EPISODE_COUNTERS = ("parse_errors", "capped_turns", "tool_calls", "malformed_calls", "tool_errors", "tool_timeouts", "obs_clipped",
                     "sandbox_kills", "format_ok",
                     # context management (rl/rollout/context.py): compactions, segments (contexts) per episode, whole
                     # turns dropped from context, summaries that reached the next context with a note
                     "compactions", "segments", "dropped_turns", "summary_problems")


def _think_tokens(e: Episode, think_start: int, think_end: int) -> int:
    """Generated tokens inside <think>...</think> (the header's <think> is not generated), in every segment."""
    n = 0
    for s in segments_of(e):
        inside = False
        for t, m in zip(s.token_ids, s.loss_mask):
            if t == think_start:
                inside = True
                continue
            if t == think_end:
                inside = False
                continue
            if inside and m:
                n += 1
    return n


def _generated(e: Episode) -> int:
    return sum(sum(s.loss_mask) for s in segments_of(e))


def _quantiles(prefix: str, values: Sequence[float], domain: str, out: dict[str, float]) -> None:
    v = np.asarray(values, dtype=np.float64)
    # numpy's default "linear" interpolation (Hyndman & Fan type 7); one call for all quantiles (one
    # sort), which matters at hundreds of domains a step
    qs = np.quantile(v, [q for _, q in QUANTILES])
    for (name, _), x in zip(QUANTILES, qs):
        out[f"{prefix}_{name}/{domain}"] = float(x)


def _sum_metric(eps: Sequence[Episode], key: str) -> float | None:
    vals = [float(e.metrics[key]) for e in eps if key in e.metrics]
    return float(np.sum(vals)) if vals else None


def rollout_metrics(groups: Sequence[RolloutGroup], think_ids: tuple[int, int] | None = None, *,
                    policy_version: int | None = None) -> dict[str, float]:
    """Per-domain episode statistics of one step's groups (see the module docstring).

    think_ids: the token ids that open and close the chat format's thinking block
    (rl.rollout.codec.reasoning_token_ids); None = the format has none, so thinking tokens are 0.
    policy_version: the trainer's version when these episodes are trained on; gives `policy/staleness_*`.
    """
    by_dom: dict[str, list[Episode]] = defaultdict(list)
    for g in groups:
        by_dom[g.domain].extend(g.episodes)
    out: dict[str, float] = {}
    for d, eps in sorted(by_dom.items()):
        if not eps:
            continue
        r = np.array([e.reward for e in eps], dtype=np.float64)
        gen = np.array([_generated(e) for e in eps], dtype=np.float64)
        think = np.array([_think_tokens(e, *think_ids) if think_ids else 0 for e in eps], dtype=np.float64)
        turns = np.array([e.num_turns for e in eps], dtype=np.float64)
        out[f"reward/mean/{d}"] = float(r.mean())
        out[f"reward/std/{d}"] = float(r.std())
        out[f"success/rate/{d}"] = float((r >= 1.0).mean())
        out[f"episodes/count/{d}"] = float(len(eps))
        out[f"tokens/response_mean/{d}"] = float(gen.mean())
        out[f"tokens/thinking_mean/{d}"] = float(think.mean())
        out[f"tokens/total_mean/{d}"] = float(np.mean([sum(len(s.token_ids) for s in segments_of(e)) for e in eps]))
        out[f"turns/mean/{d}"] = float(turns.mean())
        _quantiles("tokens/response", gen, d, out)
        _quantiles("tokens/thinking", think, d, out)
        _quantiles("turns/n", turns, d, out)
        out[f"episode/truncated_rate/{d}"] = float(np.mean([e.truncated for e in eps]))
        out[f"episode/terminated_rate/{d}"] = float(np.mean([e.terminated for e in eps]))
        out[f"episode/wall_s_mean/{d}"] = float(np.mean([e.wall_s for e in eps]))
        out[f"episode/wall_s_max/{d}"] = float(np.max([e.wall_s for e in eps]))
        out[f"episode/grade_error_rate/{d}"] = float(np.mean([e.grade_error is not None for e in eps]))
        # the largest context any episode reached (an episode that was never compacted: its whole length)
        out[per_domain("episode/context_tokens_max", d)] = float(max(
            e.metrics.get("context_tokens_max", max(len(s.token_ids) for s in segments_of(e))) for e in eps))
        for key in _EPISODE_COUNTERS + tuple(sorted({k for e in eps for k in e.metrics if k.startswith("sandbox_")} - set(_EPISODE_COUNTERS))):
            vals = [float(e.metrics[key]) for e in eps if key in e.metrics]
            if vals:
                out[f"episode/{key}_mean/{d}"] = float(np.mean(vals))
        # Tool-call error rates per call (envs/base.py counts each failure kind once per call).
        calls = _sum_metric(eps, "tool_calls")
        if calls is not None and calls > 0:
            fails = 0.0
            for key, stat in (("tool_errors", "exception_rate"), ("tool_timeouts", "timeout_rate"), ("malformed_calls", "malformed_rate")):
                s = _sum_metric(eps, key)
                if s is not None:
                    out[f"tools/{stat}/{d}"] = s / calls
                    fails += s
            out[f"tools/error_rate/{d}"] = fails / calls
            out[f"tools/calls_mean/{d}"] = calls / len(eps)
        if policy_version is not None:
            lag = np.array([policy_version - e.policy_version for e in eps], dtype=np.float64)
            out[f"policy/staleness_mean/{d}"] = float(lag.mean())
            out[f"policy/staleness_max/{d}"] = float(lag.max())
    all_r = np.array([e.reward for g in groups for e in g.episodes]) if groups else np.zeros(1)
    if all_r.size == 0:
        all_r = np.zeros(1)
    # partial rollouts: the most policy versions that generated one trained episode's tokens (1: none continued)
    versions = [float(e.metrics.get("policy_versions", 1.0)) for g in groups for e in g.episodes]
    if versions:
        out["rollout/policy_versions_per_episode_max"] = max(versions)
    out["reward/mean/all"] = float(all_r.mean())
    out["success/rate/all"] = float((all_r >= 1.0).mean())
    return out


def _check_BT(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be a tensor of shape {list(shape)}, got {list(getattr(x, 'shape', [])) or type(x).__name__}")


def _per_domain(domain_ids_B: torch.Tensor, domains: Sequence[str], mask_BT: torch.Tensor):
    """Yield (name, token mask [B, T]) for each domain with at least one masked token, then ('all', mask)."""
    if domain_ids_B.ndim != 1 or domain_ids_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(f"domain_ids_B must be [B={mask_BT.shape[0]}], got {list(domain_ids_B.shape)}")
    if domain_ids_B.numel() and (int(domain_ids_B.min()) < 0 or int(domain_ids_B.max()) >= len(domains)):
        raise ValueError(f"domain_ids_B out of range for {len(domains)} domains {tuple(domains)}")
    for i, d in enumerate(domains):
        m = mask_BT & (domain_ids_B == i)[:, None]
        if bool(m.any()):
            yield d, m
    if bool(mask_BT.any()):
        yield "all", mask_BT


@torch.no_grad()
def logprob_gap_metrics(trainer_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor,
                        domain_ids_B: torch.Tensor, domains: Sequence[str]) -> dict[str, float]:
    """Train/inference gap per domain on the generated tokens (mask_BT), same weights on both sides.

    mismatch/logprob_abs_mean, mismatch/logprob_abs_max: |log p_trainer - log p_engine| over tokens;
    mismatch/kl_k3: KL(engine || trainer) by Schulman's k3 estimator (J. Schulman, "Approximating KL
    divergence", 2020): mean of r - 1 - log r, r = p_trainer / p_engine, on tokens sampled by the engine.
    """
    B, T = mask_BT.shape
    _check_BT("trainer_logprobs_BT", trainer_logprobs_BT, (B, T))
    _check_BT("rollout_logprobs_BT", rollout_logprobs_BT, (B, T))
    mask = mask_BT.bool()
    diff = trainer_logprobs_BT.double() - rollout_logprobs_BT.double()
    k3 = torch.expm1(diff) - diff
    out: dict[str, float] = {}
    for d, m in _per_domain(domain_ids_B, domains, mask):
        a = diff[m].abs()
        out[f"mismatch/logprob_abs_mean/{d}"] = float(a.mean())
        out[f"mismatch/logprob_abs_max/{d}"] = float(a.max())
        out[f"mismatch/kl_k3/{d}"] = float(k3[m].mean())
    return out


@torch.no_grad()
def ratio_metrics(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, domain_ids_B: torch.Tensor,
                  domains: Sequence[str], *, clip_low: float = 0.2, clip_high: float = 0.28) -> dict[str, float]:
    """Per-domain PPO ratio statistics on generated tokens (the objective reports the batch-wide loss terms).

    pg/token_clipfrac_low / _high: share of tokens with ratio < 1 - clip_low / > 1 + clip_high (PPO, Schulman
    et al. 2017, arXiv:1707.06347; asymmetric bounds as in DAPO, arXiv:2503.14476); pg/ratio_mean;
    pg/neg_logprob_mean: mean -log p of the sampled tokens (a Monte-Carlo entropy estimate at temperature 1).
    """
    B, T = mask_BT.shape
    _check_BT("logprobs_BT", logprobs_BT, (B, T))
    _check_BT("old_logprobs_BT", old_logprobs_BT, (B, T))
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low={clip_low} and clip_high={clip_high} must be >= 0")
    mask = mask_BT.bool()
    ratio = torch.exp(logprobs_BT.double() - old_logprobs_BT.double())
    out: dict[str, float] = {}
    for d, m in _per_domain(domain_ids_B, domains, mask):
        r = ratio[m]
        out[f"pg/token_clipfrac_low/{d}"] = float((r < 1 - clip_low).double().mean())
        out[f"pg/token_clipfrac_high/{d}"] = float((r > 1 + clip_high).double().mean())
        out[f"pg/ratio_mean/{d}"] = float(r.mean())
        out[f"pg/neg_logprob_mean/{d}"] = float(-logprobs_BT.double()[m].mean())
    return out


def time_breakdown(groups: Sequence[RolloutGroup], *, step_s: float, rollout_s: float, train_busy_s: float,
                   sync_s: float) -> dict[str, float]:
    """Where one driver step's wall time went: rollout (split into generation / tools / grading),
    training, weight sync, and how long the trainer and the rollout engines sat idle.

    Episodes of a step run concurrently, so the rollout phase's wall time is split in the ratio of
    the episodes' summed generate / tool / grade seconds (agent_loop records them per episode).
    In async mode the update of step n runs during the rollout of step n+1: then train and rollout
    overlap, and the idle figures show what the overlap saved.
    """
    eps = [e for g in groups for e in g.episodes]
    parts = {k: sum(float(e.metrics.get(f"time_{k}_s", 0.0)) for e in eps) for k in ("generate", "tools", "grade")}
    total = sum(parts.values())
    out = {"time/rollout_s": rollout_s, "time/train_s": train_busy_s, "time/sync_s": sync_s, "time/step_s": step_s}
    for k, v in parts.items():
        out[f"time/rollout_{k}_s"] = rollout_s * v / total if total > 0 else 0.0
    out["time/trainer_idle_s"] = max(step_s - train_busy_s - sync_s, 0.0)
    out["time/rollout_idle_s"] = max(step_s - rollout_s - sync_s, 0.0)
    return out
