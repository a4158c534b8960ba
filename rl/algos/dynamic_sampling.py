"""Dynamic sampling helpers (DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.2).

A group whose G samples all got the same reward has zero advantage under every group-baseline
estimator (grpo, dr_grpo, rloo): it costs a forward/backward and teaches nothing, and it shrinks the
effective batch. DAPO filters such groups and over-samples until the batch is full of informative
groups. This module finds them: `zero_variance_groups` over a flat batch, `group_signal` over rollout
groups given as reward lists (the one rule the training loop and the domain sampler use). The driver
decides whether to filter or re-sample.
Metrics include the zero-variance fraction per domain: a domain that is all-solved or all-failed shows
up here first (and is what adaptive domain weights react to).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

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


@dataclass(frozen=True)
class GroupSignal:
    """Which rollout groups carry a learning signal, and each label's fraction of groups that do not."""

    has_signal_G: tuple[bool, ...]  # per group, in input order: its rewards differ by more than atol
    zero_var_frac: Mapping[str, float]  # per label (a domain, or whatever unit the caller groups by), labels sorted

    def metrics(self, prefix: str = "rollout/zero_var_frac") -> dict[str, float]:
        """`{prefix}/{label}` -> zero-variance fraction: the per-domain keys the training loop logs."""
        return {f"{prefix}/{label}": frac for label, frac in self.zero_var_frac.items()}


def group_signal(rewards_G: Sequence[Sequence[float]], labels_G: Sequence[str], *, atol: float = 0.0) -> GroupSignal:
    """The zero-variance rule of `zero_variance_groups` over rollout groups given as reward lists.

    `rewards_G[g]` holds group g's rewards (one per sample, at least one), `labels_G[g]` its domain (or
    unit). Rewards are compared as float32, the dtype the trainer's batch holds them in.
    """
    if len(rewards_G) != len(labels_G):
        raise ValueError(f"{len(rewards_G)} reward groups but {len(labels_G)} labels")
    sizes_G = [len(r) for r in rewards_G]
    if 0 in sizes_G:
        raise ValueError(f"group {sizes_G.index(0)} has no rewards")
    if not rewards_G:
        return GroupSignal((), {})
    labels = sorted(set(labels_G))
    sizes = torch.tensor(sizes_G)
    rewards_B = torch.tensor([float(x) for r in rewards_G for x in r], dtype=torch.float32)
    group_ids_B = torch.repeat_interleave(torch.arange(len(rewards_G)), sizes)
    label_ids_B = torch.repeat_interleave(torch.tensor([labels.index(x) for x in labels_G]), sizes)
    keep_B, _ = zero_variance_groups(rewards_B, group_ids_B, label_ids_B, atol=atol)
    has_signal_G = tuple(bool(k) for k in keep_B[torch.cumsum(sizes, 0) - sizes].tolist())
    frac = {}
    for label in labels:
        mine = [h for h, x in zip(has_signal_G, labels_G) if x == label]
        frac[label] = sum(not h for h in mine) / len(mine)
    return GroupSignal(has_signal_G, frac)
