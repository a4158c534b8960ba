"""KL divergence to a reference policy, estimated per token from sampled tokens: k1, k2, k3.

What it does: the three estimators of John Schulman's note "Approximating KL Divergence" (2020),
with log r = log pi_ref(y_t) - log pi(y_t) on tokens sampled from pi:
  k1 = -log r                 (unbiased for KL(pi || ref), high variance, can be negative)
  k2 = (log r)^2 / 2          (biased, low variance)
  k3 = (r - 1) - log r        (unbiased for KL(pi || ref), always >= 0, low variance; DeepSeekMath's GRPO KL term)
Two ways to use it: as a loss term (`kl_loss`: aggregated like the policy loss, times a coefficient),
or folded into the reward (`kl_reward_penalty`: -coef * kl per token, detached, for `gae` /
`reinforce_pp` / summed into an outcome reward).
Values and gradients are different questions. Differentiated as a loss on tokens sampled from pi
(no reweighting), the expected gradients are: k3 -> grad KL(ref || pi), the *other* direction from the
KL its value estimates (the same holds for TRL's GRPO KL term and verl's `low_var_kl`); k2 ->
grad KL(pi || ref); k1 -> 0 (E_pi[grad log pi] = 0: k1 only acts through the reward). Both KL
directions vanish at pi = ref and pull pi toward ref; they weigh tokens differently (KL(ref || pi) is
mass-covering: it punishes pi for dropping tokens ref likes). tests/rl/algos checks these by enumeration.
The |log r| clamp (`clamp`) bounds the value and also zeroes the gradient of the tokens it clamps.
What it does not do: run the reference model.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from rl.algos._common import check_float, check_mask, check_same_shape, check_tensor, stats
from rl.algos.aggregation import aggregation_weights, reduce
from rl.algos.registry import Registry

Metrics = dict[str, float]
KLFn = Callable[[Tensor], Tensor]  # log_r_BT = ref - logprobs  ->  kl_BT
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_r: Tensor) -> Tensor:
    return -log_r


@KL_ESTIMATORS.register("k2")
def _k2(log_r: Tensor) -> Tensor:
    return 0.5 * log_r * log_r


@KL_ESTIMATORS.register("k3")
def _k3(log_r: Tensor) -> Tensor:
    return torch.expm1(log_r) - log_r  # expm1: exact near r = 1, where most tokens are


def kl_per_token(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    estimator: str = "k3",
    *,
    clamp: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """kl_BT (0 off the mask; gradient flows through logprobs_BT only) and its stats.

    `clamp` bounds |log r| before the estimator (a reference far from the policy on a few tokens
    would otherwise dominate k3 through exp); None disables it.
    """
    fn = KL_ESTIMATORS.get(estimator)
    mask = check_mask("mask_BT", mask_BT)
    check_float("logprobs_BT", check_tensor("logprobs_BT", logprobs_BT, 2))
    check_float("ref_logprobs_BT", check_tensor("ref_logprobs_BT", ref_logprobs_BT, 2))
    check_same_shape(mask_BT=mask, logprobs_BT=logprobs_BT, ref_logprobs_BT=ref_logprobs_BT)
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp={clamp} must be > 0 or None")
    zero = torch.zeros((), dtype=logprobs_BT.dtype, device=logprobs_BT.device)
    log_r = torch.where(mask, ref_logprobs_BT.detach() - logprobs_BT, zero)
    if clamp is not None:
        log_r = log_r.clamp(-clamp, clamp)
    kl_BT = torch.where(mask, fn(log_r), zero)
    return kl_BT, stats(f"kl/{estimator}", kl_BT, mask)


def kl_loss(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    estimator: str = "k3",
    coef: float = 1.0,
    aggregation: str = "token_mean",
    domain_ids_B: Tensor | None = None,
    domain_weights: Mapping[int, float] | None = None,
    weights_BT: Tensor | None = None,
    clamp: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """coef * aggregate(kl_BT): the KL-as-loss form (GRPO). Returns (scalar, metrics)."""
    kl_BT, metrics = kl_per_token(logprobs_BT, ref_logprobs_BT, mask_BT, estimator, clamp=clamp)
    mask = check_mask("mask_BT", mask_BT)
    if weights_BT is None:
        weights_BT, _ = aggregation_weights(aggregation, mask, domain_ids_B=domain_ids_B, domain_weights=domain_weights, dtype=kl_BT.dtype)
    kl = reduce(kl_BT, weights_BT, mask)
    metrics["kl/value"] = float(kl.detach())
    metrics["kl/coef"] = float(coef)
    return coef * kl, metrics


def kl_reward_penalty(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    coef: float,
    estimator: str = "k1",
    clamp: float | None = 10.0,
) -> tuple[Tensor, Metrics]:
    """KL folded into the reward: token_rewards_BT = -coef * kl_BT (detached; 0 off the mask).

    Feed it as `AdvantageInputs.token_rewards_BT`. k1 is the usual choice here (InstructGPT-style
    per-token penalty): its sum over a sequence is the sequence's log-likelihood ratio.
    """
    kl_BT, metrics = kl_per_token(logprobs_BT.detach(), ref_logprobs_BT, mask_BT, estimator, clamp=clamp)
    mask = check_mask("mask_BT", mask_BT)
    penalty_BT = -coef * kl_BT
    metrics["kl/coef"] = float(coef)
    metrics["kl/reward_penalty_per_seq"] = float(penalty_BT.sum(dim=1)[mask.any(dim=1)].mean()) if bool(mask.any()) else 0.0
    return penalty_BT, metrics
