"""Clipped value loss for the PPO critic (used with the `gae` advantage estimator).

Loss per generated token (PPO2 as in OpenAI baselines; discussed in Andrychowicz et al. 2021, "What
Matters in On-Policy RL", arXiv:2006.05990):
  v_clip = old_v + clip(v - old_v, -clip, +clip)
  loss_t = 1/2 * max((v - R)^2, (v_clip - R)^2)
so the critic cannot move further than `clip` from the values used for the advantages in one update
(pessimistic: the larger error is kept). R are the GAE returns (`advantages.gae_returns_BT`).
What it does not do: run the critic, or compute the returns.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from rl.algos._common import check_float, check_mask, check_same_shape, masked_mean, masked_sum, stats
from rl.algos.aggregation import aggregation_weights, reduce

Metrics = dict[str, float]


def clipped_value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
    domain_ids_B: Tensor | None = None,
    domain_weights: Mapping[int, float] | None = None,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Returns (scalar loss, metrics). clip=None gives the plain 1/2 (v - R)^2 regression."""
    mask = check_mask("mask_BT", mask_BT)
    for name, t in (("values_BT", values_BT), ("old_values_BT", old_values_BT), ("returns_BT", returns_BT)):
        check_float(name, t)
    check_same_shape(mask_BT=mask, values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    if clip is not None and not clip > 0:
        raise ValueError(f"clip={clip} must be > 0 or None")
    zero = torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)
    v = torch.where(mask, values_BT, zero)
    old = torch.where(mask, old_values_BT.detach(), zero)
    ret = torch.where(mask, returns_BT.detach(), zero)
    err_BT = (v - ret) ** 2
    if clip is None:
        loss_BT = 0.5 * err_BT
        clipped_BT = torch.zeros_like(mask)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip_BT = (v_clip - ret) ** 2
        loss_BT = 0.5 * torch.maximum(err_BT, err_clip_BT)
        clipped_BT = err_clip_BT > err_BT
    if weights_BT is None:
        weights_BT, _ = aggregation_weights(aggregation, mask, domain_ids_B=domain_ids_B, domain_weights=domain_weights, dtype=loss_BT.dtype)
    loss = reduce(loss_BT, weights_BT, mask)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        ret_mean = masked_sum(ret, mask) / n
        var_ret = masked_sum((ret - ret_mean) ** 2, mask) / n
        resid = ret - v
        resid_mean = masked_sum(resid, mask) / n
        var_resid = masked_sum((resid - resid_mean) ** 2, mask) / n
        metrics: Metrics = {
            "vf/loss": float(loss.detach()),
            "vf/clipfrac": float(masked_mean(clipped_BT.float(), mask)),
            # 1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 no better than a constant
            "vf/explained_var": float(1 - var_resid / var_ret) if float(var_ret) > 0 else 0.0,
            **stats("vf/value", v, mask),
        }
    return loss, metrics
