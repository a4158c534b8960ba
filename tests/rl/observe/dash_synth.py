"""A synthetic but real-data-flow run directory for the dashboard tests and the benchmark.

Episodes and MoE routes are generated with known, domain-dependent behaviour; every metric then goes
through the real producers (rl.observe.telemetry, rl.observe.moe, rl.train.dynamic_sampling) and the real
MetricsSink, exactly as the driver does. Only the model and environments are replaced by a generator.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from jointrl.records import Message
from rl.observe.sink import MetricsSink
from rl.observe.moe import moe_telemetry, token_domain_ids
from rl.observe.telemetry import logprob_gap_metrics, ratio_metrics, rollout_metrics
from rl.train import dynamic_sampling
from rl.types import Episode, RolloutGroup, StepMetrics

DOMAINS = ("cad", "swe", "terminal")
THINK = (4, 5)
EVIL = "<script>console.error('injected')</script> & <b>bold</b>"


def make_episode(rng: np.random.Generator, domain: str, gid: str, step: int, p_success: float, *, policy_version: int) -> Episode:
    n_prompt = int(rng.integers(6, 12))
    turns = int(rng.integers(1, 5))
    ids, mask = [int(x) for x in rng.integers(10, 100, n_prompt)], [0] * n_prompt
    for t in range(turns):
        think = int(rng.integers(0, 6))
        ans = int(rng.integers(2, 10))
        ids += [THINK[0]] + [int(x) for x in rng.integers(10, 100, think)] + [THINK[1]] + [int(x) for x in rng.integers(10, 100, ans)]
        mask += [1] * (think + 2 + ans)
        tool = int(rng.integers(3, 8))
        ids += [int(x) for x in rng.integers(10, 100, tool)]
        mask += [0] * tool
    lps = [float(-rng.exponential(0.7)) if m else 0.0 for m in mask]
    success = rng.random() < p_success
    reward = 1.0 if success else float(rng.choice([0.0, 0.25, 0.5]))
    calls = float(turns)
    return Episode(task_id=f"{domain}-{gid}", domain=domain, group_id=gid, token_ids=tuple(ids), loss_mask=tuple(mask),
                   rollout_logprobs=tuple(lps), messages=(Message(role="user", content="hi"),), reward=reward,
                   metrics={"tool_calls": calls, "tool_errors": float(rng.integers(0, 2)), "tool_timeouts": 0.0,
                            "malformed_calls": float(rng.random() < 0.2), "parse_errors": 0.0, "sandbox_kills": float(rng.random() < 0.1)},
                   terminated=success, truncated=not success and rng.random() < 0.3, num_turns=turns,
                   policy_version=policy_version, wall_s=float(rng.uniform(0.5, 3.0)))


def make_groups(rng: np.random.Generator, step: int, tasks_per_domain: int = 2, G: int = 4) -> list[RolloutGroup]:
    groups = []
    for di, d in enumerate(DOMAINS):
        p = min(0.95, 0.15 + 0.1 * di + 0.04 * step)  # rewards improve over steps, differently per domain
        for t in range(tasks_per_domain):
            gid = f"s{step}-{d}-{t}"
            groups.append(RolloutGroup(task_id=f"{d}-{t}", domain=d,
                                       episodes=tuple(make_episode(rng, d, gid, step, p, policy_version=step) for _ in range(G))))
    return groups


def moe_step(gen: torch.Generator, B: int, T: int, L: int = 2, E: int = 8, K: int = 2) -> dict[str, float]:
    """Router logits with a per-domain expert preference (domain d prefers experts 2d, 2d+1), replayed
    routes that differ from the fresh choice on some tokens, and right padding."""
    dom_B = torch.arange(B) % len(DOMAINS)
    pref_DE = torch.zeros(len(DOMAINS), E)
    for d in range(len(DOMAINS)):
        pref_DE[d, (2 * d) % E] = 2.0
        pref_DE[d, (2 * d + 1) % E] = 1.5
    dom_N = token_domain_ids(dom_B, T)
    logits_LNE = torch.randn(L, B * T, E, generator=gen) + pref_DE[dom_N][None]
    fresh = logits_LNE.topk(K, dim=-1).indices
    replayed = fresh.clone()
    flip = torch.rand(L, B * T, generator=gen) < 0.08
    replayed[..., 1] = torch.where(flip, (fresh[..., 1] + 3) % E, fresh[..., 1])
    same = replayed[..., 1] == replayed[..., 0]
    replayed[..., 1] = torch.where(same, (replayed[..., 1] + 1) % E, replayed[..., 1])
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask_N = (torch.arange(T)[None, :] < lengths[:, None]).reshape(-1)
    return moe_telemetry(replayed, dom_N, DOMAINS, E, token_mask_N=mask_N, router_logits=logits_LNE, fresh_routes_LNK=fresh)


def build_run(run_dir: Path, steps: int = 8, seed: int = 0, wandb_mode: str = "disabled") -> Path:
    """Write `steps` steps of metrics + samples into run_dir through MetricsSink; returns run_dir."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    sink = MetricsSink(run_dir, wandb_mode=wandb_mode, run_name="synthetic", config={"name": "synthetic"})
    try:
        for step in range(steps):
            groups = make_groups(rng, step)
            values = rollout_metrics(groups, THINK, policy_version=step)
            _, ds = dynamic_sampling(groups, "off")
            values.update(ds)
            B, T = len(groups) * 4, 24
            dom_B = torch.tensor([DOMAINS.index(g.domain) for g in groups for _ in g.episodes])
            mask_BT = torch.rand(B, T, generator=gen) < 0.6
            roll = -torch.rand(B, T, generator=gen) * 2
            trainer = roll + 0.01 * (1 + dom_B[:, None]) * torch.randn(B, T, generator=gen)
            values.update(logprob_gap_metrics(trainer, roll, mask_BT, dom_B, DOMAINS))
            values.update(ratio_metrics(trainer, roll, mask_BT, dom_B, DOMAINS, clip_low=0.2, clip_high=0.28))
            values.update(moe_step(gen, B, T))
            values.update({"pg/loss": float(0.1 * np.cos(step)), "kl/value": 0.01 * step, "router/aux_loss": 1.02,
                           "router/z_loss": 3.1, "loss/total": float(0.1 * np.cos(step) + 0.001),
                           "train/grad_norm": float(1.0 / (1 + step)), "pg/clipfrac": 0.05, "mismatch/logprob_abs_mean": 0.012,
                           "time/step_s": 1.5, "time/rollout_s": 1.0, "time/train_s": 0.4, "time/sync_s": 0.1,
                           "bad/nan_value": float("nan")})
            values.update({f"sampler/weight/{d}": 1 / len(DOMAINS) for d in DOMAINS})
            samples = [{"domain": g.domain, "task_id": e.task_id, "reward": f"{e.reward:.3f}", "turns": str(e.num_turns),
                        "transcript": f"step {step} {g.domain} transcript {EVIL}"} for g in groups[::2] for e in g.episodes[:1]]
            sink.log(StepMetrics(step=step, values=values, samples=samples))
    finally:
        sink.close()
    return run_dir
