"""Policy-gradient surrogate losses: PPO-clip (asymmetric), dual-clip, GSPO, CISPO.

What it does: each registered loss (registry `POLICY_LOSSES`) maps `PolicyLossInputs` to a per-token
loss `loss_BT` and metrics; `compute_policy_loss` then reduces it with an aggregation mode from
`aggregation` (the aggregation is a parameter, never a fork of the loss). Optional off-policy
correction weights (`is_weights_BT`, from `off_policy`) multiply each token's loss.
What it does not do: compute logprobs, the KL term, entropy bonuses or the value loss.

Ratios: r_t = exp(logprobs_BT - old_logprobs_BT), with the log-ratio clamped to +-log_ratio_clamp
before exp so one wild token cannot produce inf. The clamp is not free: a clamped value has zero
gradient, so a token with |log r| > log_ratio_clamp loses the gradient that flows through r. For
`ppo_clip` and `dual_clip` that matters only for A < 0 and r > e^clamp, where the unclipped gradient
-A * r * grad log pi is astronomically large (the clip already drops A > 0, r > 1 + clip_high, and
r < e^-clamp weighs its gradient by less than 2e-9). `gspo` takes its gradient through log pi
directly; there the clamp bounds each token's part of the sequence ratio. `cispo` takes its
gradient through log pi directly and its weight from the unclamped ratio, so every token keeps its
bounded gradient whatever its ratio (as in the paper, verl and TRL).
Every loss is written so that at r = 1 its value is -A per token: under any aggregation the loss is
then minus the aggregated advantage (a check in the tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from rl.algos._common import check_float, check_mask, check_same_shape, check_tensor, masked_mean, masked_sum, stats
from rl.algos.aggregation import aggregation_weights, reduce
from rl.algos.registry import Registry

Metrics = dict[str, float]


@dataclass(frozen=True)
class PolicyLossInputs:
    logprobs_BT: Tensor  # float [B, T]: current policy's logprob of each token (carries the gradient)
    old_logprobs_BT: Tensor  # float [B, T]: logprob under the policy that produced the batch (pi_old)
    advantages_BT: Tensor  # float [B, T], or [B] (one advantage per sequence, broadcast)
    mask_BT: Tensor  # [B, T]: 1 on policy-generated tokens only
    is_weights_BT: Tensor | None = None  # float [B, T]: off-policy correction weights (e.g. TIS), no gradient


@dataclass(frozen=True)
class PolicyLossParams:
    clip_low: float = 0.2  # ratio lower bound 1 - clip_low (PPO, DAPO)
    clip_high: float = 0.28  # ratio upper bound 1 + clip_high (DAPO's clip-higher); GSPO's paper uses 3e-4 / 4e-4
    dual_clip_c: float = 3.0  # dual-clip bound c > 1 for negative advantages (Ye et al. 2020)
    log_ratio_clamp: float = 20.0  # |log r| is clamped to this before exp

    def __post_init__(self) -> None:
        if not self.clip_low >= 0 or not self.clip_high >= 0:
            raise ValueError(f"clip_low={self.clip_low} and clip_high={self.clip_high} must be >= 0")
        if not self.dual_clip_c > 1:
            raise ValueError(f"dual_clip_c={self.dual_clip_c} must be > 1 (the dual clip bounds -A*r by -c*A for A<0)")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp} must be > 0")


PolicyLossFn = Callable[[PolicyLossInputs, PolicyLossParams], "tuple[Tensor, Metrics]"]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def compute_policy_loss(
    name: str,
    inputs: PolicyLossInputs,
    params: PolicyLossParams | None = None,
    *,
    aggregation: str = "token_mean",
    domain_ids_B: Tensor | None = None,
    domain_weights: Mapping[int, float] | None = None,
    domain_names: Mapping[int, str] | None = None,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Per-token loss of policy loss `name`, reduced by `aggregation` (or by precomputed `weights_BT`).

    Pass `weights_BT` (from `aggregation.aggregation_weights` on the whole step batch, sliced to this
    micro-batch) when accumulating gradients; otherwise the weights are computed on this batch.
    """
    loss_BT, metrics = POLICY_LOSSES.get(name)(inputs, params or PolicyLossParams())
    mask = check_mask("mask_BT", inputs.mask_BT)
    if weights_BT is None:
        weights_BT, agg_metrics = aggregation_weights(
            aggregation, mask, domain_ids_B=domain_ids_B, domain_weights=domain_weights, domain_names=domain_names, dtype=loss_BT.dtype
        )
        metrics.update(agg_metrics)
    loss = reduce(loss_BT, weights_BT, mask)
    metrics["pg/loss"] = float(loss.detach())
    return loss, metrics


# ----------------------------------------------------------------------------- shared pieces
def _prepare(inputs: PolicyLossInputs, params: PolicyLossParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validated (mask bool, log_ratio_BT, ratio_BT, adv_BT). Off-mask entries are sanitised to 0 / ratio 1."""
    mask = check_mask("mask_BT", inputs.mask_BT)
    lp = check_float("logprobs_BT", check_tensor("logprobs_BT", inputs.logprobs_BT, 2))
    old = check_float("old_logprobs_BT", check_tensor("old_logprobs_BT", inputs.old_logprobs_BT, 2))
    check_same_shape(mask_BT=mask, logprobs_BT=lp, old_logprobs_BT=old)
    adv = check_float("advantages_BT", check_tensor("advantages_BT", inputs.advantages_BT))
    if adv.ndim == 1:
        if adv.shape[0] != mask.shape[0]:
            raise ValueError(f"advantages_BT given per sequence has {adv.shape[0]} entries but mask_BT has {mask.shape[0]} rows")
        adv = adv[:, None].expand(mask.shape)
    else:
        check_same_shape(mask_BT=mask, advantages_BT=adv)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    # where() on both branches: a NaN/-inf logprob in padding must not leak into values or gradients.
    log_ratio_BT = torch.where(mask, lp - old.detach(), zero).clamp(-params.log_ratio_clamp, params.log_ratio_clamp)
    ratio_BT = torch.exp(log_ratio_BT)
    adv = torch.where(mask, adv.detach(), zero)
    return mask, log_ratio_BT, ratio_BT, adv


def _apply_is_weights(loss_BT: Tensor, inputs: PolicyLossInputs, mask: Tensor, metrics: Metrics) -> Tensor:
    if inputs.is_weights_BT is None:
        return loss_BT
    w = check_float("is_weights_BT", inputs.is_weights_BT)
    check_same_shape(mask_BT=mask, is_weights_BT=w)
    w = torch.where(mask, w.detach(), torch.zeros((), dtype=w.dtype, device=w.device))
    metrics.update(stats("pg/is_weight", w, mask))
    return loss_BT * w.to(loss_BT.dtype)


@torch.no_grad()
def _ratio_metrics(log_ratio_BT: Tensor, ratio_BT: Tensor, mask: Tensor) -> Metrics:
    m = stats("pg/ratio", ratio_BT, mask)
    # k3 estimate of KL(pi_old || pi) from samples of pi_old (Schulman 2020): r - 1 - log r
    m["pg/approx_kl"] = float(masked_mean(ratio_BT - 1 - log_ratio_BT, mask))
    return m


def _frac(x_BT: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x_BT.to(torch.float32), mask))


# ----------------------------------------------------------------------------- losses
def _ppo_token_loss(ratio_BT: Tensor, adv_BT: Tensor, params: PolicyLossParams) -> tuple[Tensor, Tensor, Tensor]:
    """-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A), with the masks of tokens clipped low / high."""
    clipped = ratio_BT.clamp(1.0 - params.clip_low, 1.0 + params.clip_high)
    loss_BT = -torch.minimum(ratio_BT * adv_BT, clipped * adv_BT)
    # tokens whose gradient the clip removes: pushed beyond the bound in the advantage's direction
    hi_BT = (adv_BT > 0) & (ratio_BT > 1.0 + params.clip_high)
    lo_BT = (adv_BT < 0) & (ratio_BT < 1.0 - params.clip_low)
    return loss_BT, lo_BT, hi_BT


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(inputs: PolicyLossInputs, params: PolicyLossParams) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with separate low / high clip
    ranges (DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476). Returns (loss_BT, metrics)."""
    mask, log_ratio, ratio, adv = _prepare(inputs, params)
    loss_BT, lo, hi = _ppo_token_loss(ratio, adv, params)
    metrics = _ratio_metrics(log_ratio, ratio, mask)
    metrics.update({"pg/clipfrac": _frac(lo | hi, mask), "pg/clipfrac_low": _frac(lo, mask), "pg/clipfrac_high": _frac(hi, mask)})
    return _apply_is_weights(loss_BT, inputs, mask, metrics), metrics


@POLICY_LOSSES.register("dual_clip")
def dual_clip_loss(inputs: PolicyLossInputs, params: PolicyLossParams) -> tuple[Tensor, Metrics]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games", arXiv:1912.09729).

    For A < 0 the objective max(min(r*A, clip(r)*A), c*A) stops a huge ratio on a bad token from
    producing an unbounded loss; for A >= 0 it is PPO-clip.
    """
    mask, log_ratio, ratio, adv = _prepare(inputs, params)
    ppo_BT, lo, hi = _ppo_token_loss(ratio, adv, params)
    bound_BT = -params.dual_clip_c * adv  # the loss may not exceed -c*A when A < 0
    dual_BT = (adv < 0) & (ppo_BT > bound_BT)
    loss_BT = torch.where(adv < 0, torch.minimum(ppo_BT, bound_BT), ppo_BT)
    metrics = _ratio_metrics(log_ratio, ratio, mask)
    metrics.update(
        {
            "pg/clipfrac": _frac(lo | hi | dual_BT, mask),
            "pg/clipfrac_low": _frac(lo, mask),
            "pg/clipfrac_high": _frac(hi, mask),
            "pg/dual_clipfrac": _frac(dual_BT, mask),
        }
    )
    return _apply_is_weights(loss_BT, inputs, mask, metrics), metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(inputs: PolicyLossInputs, params: PolicyLossParams) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071), token form.

    s_i = (pi/pi_old)(y_i)^(1/|y_i|) = exp(mean_t log r_t) over the sequence's generated tokens;
    clipping is per sequence. Token form ("GSPO-token"): s_it = sg[s_i] * pi(y_t)/sg[pi(y_t)] has value
    s_i and gradient s_i * grad log pi(y_t), so aggregating -min(s_it*A, clip(s_it)*A) with
    `seq_mean_token_mean` gives exactly the paper's sequence-level gradient, while other aggregation
    modes stay available. With length-1 sequences this is token-level PPO-clip.
    """
    mask, log_ratio, ratio, adv = _prepare(inputs, params)
    len_B = mask.sum(dim=1)
    seq_log_ratio_B = masked_sum(log_ratio, mask, dim=1) / len_B.clamp(min=1).to(log_ratio.dtype)
    lp = inputs.logprobs_BT
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    token_part_BT = torch.where(mask, lp - lp.detach(), zero)  # value 0, gradient grad log pi
    seq_ratio_BT = torch.exp(seq_log_ratio_B.detach()[:, None] + token_part_BT)
    loss_BT, lo, hi = _ppo_token_loss(seq_ratio_BT, adv, params)
    has_B = len_B > 0
    seq_ratio_B = torch.exp(seq_log_ratio_B.detach())
    metrics = _ratio_metrics(log_ratio, ratio, mask)
    metrics.update(stats("pg/seq_ratio", seq_ratio_B, has_B))
    # fraction of sequences clipped (every token of a sequence shares its clip state)
    seq_clipped_B = (lo | hi).any(dim=1)
    metrics["pg/clipfrac"] = float(seq_clipped_B[has_B].float().mean()) if bool(has_B.any()) else 0.0
    metrics["pg/clipfrac_low"] = float(lo.any(dim=1)[has_B].float().mean()) if bool(has_B.any()) else 0.0
    metrics["pg/clipfrac_high"] = float(hi.any(dim=1)[has_B].float().mean()) if bool(has_B.any()) else 0.0
    return _apply_is_weights(loss_BT, inputs, mask, metrics), metrics


@POLICY_LOSSES.register("cispo")
def cispo_loss(inputs: PolicyLossInputs, params: PolicyLossParams) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax-M1 report, 2025, arXiv:2506.13585): clipped, stop-gradient importance weight.

    Paper form: -sg(clip(r, 1-clip_low, 1+clip_high)) * A * log pi — every token keeps a gradient
    (none is dropped as PPO's clip does), only its weight is capped. Written here as
    -sg(clip(r)) * A * (1 + log pi - sg(log pi)): the same gradient, sg(clip(r)) * A * grad log pi,
    and a loss value equal to the clipped surrogate -clip(r)*A (so -A at r = 1). The gradient never
    passes through r, and the weight is taken from the unclamped log-ratio, so the log-ratio clamp
    removes no token's gradient: a token with log r = +40 keeps (1 + clip_high) * A * grad log pi, one
    with log r = -40 keeps max(r, 1 - clip_low) * A * grad log pi. MiniMax-M1 effectively sets no lower
    bound (clip_low >= 1) and tunes only clip_high.
    """
    mask, log_ratio, ratio, adv = _prepare(inputs, params)
    lp = inputs.logprobs_BT
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    with torch.no_grad():
        raw_log_ratio_BT = torch.where(mask, lp - inputs.old_logprobs_BT, zero)
        # exp overflows to +inf far above the clip, and clamp maps +inf to 1 + clip_high: no clamp needed here
        raw_ratio_BT = torch.exp(raw_log_ratio_BT)
        weight_BT = raw_ratio_BT.clamp(1.0 - params.clip_low, 1.0 + params.clip_high)
    token_part_BT = torch.where(mask, lp - lp.detach(), zero)  # value 0, gradient grad log pi
    loss_BT = -weight_BT * adv * (1.0 + token_part_BT)
    metrics = _ratio_metrics(log_ratio, ratio, mask)
    hi = raw_ratio_BT > 1.0 + params.clip_high
    lo = raw_ratio_BT < 1.0 - params.clip_low
    metrics.update({"pg/clipfrac": _frac(lo | hi, mask), "pg/clipfrac_low": _frac(lo, mask), "pg/clipfrac_high": _frac(hi, mask)})
    return _apply_is_weights(loss_BT, inputs, mask, metrics), metrics
