"""Dynamic sampling helpers (DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.2).

A group whose G samples all got the same reward has zero advantage under every group-baseline
estimator (grpo, dr_grpo, rloo): it costs a forward/backward and teaches nothing, and it shrinks the
effective batch. DAPO filters such groups and over-samples until the batch is full of informative
groups. This module finds them (`zero_variance_groups`) and sizes the over-sampling
(`groups_to_sample`); the driver decides whether to filter or re-sample.
Metrics include the zero-variance fraction per domain: a domain that is all-solved or all-failed shows
up here first (and is what adaptive domain weights react to).
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor

from rl.algos._common import check_float, check_ids, check_tensor, group_inverse

Metrics = dict[str, float]


@torch.no_grad()
def zero_variance_groups(
    rewards_B: Tensor,
    group_ids_B: Tensor,
    domain_ids_B: Tensor | None = None,
    *,
    atol: float = 0.0,
    domain_names: Mapping[int, str] | None = None,
) -> tuple[Tensor, Metrics]:
    """keep_B (bool [B]): True for samples of groups whose rewards differ by more than `atol`.

    A group of one sample counts as zero-variance. Every sample of a group must share its domain.
    """
    check_float("rewards_B", check_tensor("rewards_B", rewards_B, 1))
    check_ids("group_ids_B", group_ids_B, rewards_B.shape[0])
    if not atol >= 0:
        raise ValueError(f"atol={atol} must be >= 0")
    if not bool(torch.isfinite(rewards_B).all()):
        raise ValueError("rewards_B contains non-finite values")
    inv_B, n = group_inverse(group_ids_B)
    big = torch.finfo(rewards_B.dtype).max
    max_G = torch.full((n,), -big, dtype=rewards_B.dtype, device=rewards_B.device).scatter_reduce(0, inv_B, rewards_B, "amax")
    min_G = torch.full((n,), big, dtype=rewards_B.dtype, device=rewards_B.device).scatter_reduce(0, inv_B, rewards_B, "amin")
    zero_var_G = (max_G - min_G) <= atol
    keep_B = ~zero_var_G[inv_B]
    metrics: Metrics = {
        "dynsample/num_groups": float(n),
        "dynsample/zero_var_group_frac": float(zero_var_G.float().mean()) if n else 0.0,
        "dynsample/kept_sample_frac": float(keep_B.float().mean()) if keep_B.numel() else 0.0,
    }
    if domain_ids_B is not None:
        check_ids("domain_ids_B", domain_ids_B, rewards_B.shape[0])
        dom_G = torch.zeros(n, dtype=domain_ids_B.dtype, device=domain_ids_B.device).scatter(0, inv_B, domain_ids_B)
        if not bool((dom_G[inv_B] == domain_ids_B).all()):
            bad = int(group_ids_B[dom_G[inv_B] != domain_ids_B][0])
            raise ValueError(f"group {bad} mixes domains; every sample of a group must have the same domain id")
        for d in torch.unique(dom_G).tolist():
            in_d = dom_G == d
            label = domain_names.get(int(d), str(d)) if domain_names else str(d)
            metrics[f"dynsample/zero_var_group_frac/{label}"] = float(zero_var_G[in_d].float().mean())
            metrics[f"dynsample/num_groups/{label}"] = float(in_d.sum())
    return keep_B, metrics


def groups_to_sample(num_needed: int, kept_group_frac: float, *, max_factor: float = 3.0) -> int:
    """How many groups to roll out to expect `num_needed` informative ones, given the recent kept
    fraction; the over-sampling factor is capped at `max_factor` so an all-solved domain cannot ask
    for an unbounded number of rollouts."""
    if num_needed < 0:
        raise ValueError(f"num_needed={num_needed} must be >= 0")
    if not 0.0 <= kept_group_frac <= 1.0:
        raise ValueError(f"kept_group_frac={kept_group_frac} must be in [0, 1]")
    if not max_factor >= 1.0:
        raise ValueError(f"max_factor={max_factor} must be >= 1")
    factor = min(max_factor, 1.0 / kept_group_frac) if kept_group_frac > 0 else max_factor
    return int(math.ceil(num_needed * factor - 1e-9))
