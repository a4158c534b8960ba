"""The Tinker API's built-in loss functions, mapped onto the policy losses of rl/algos.

Tinker's losses are sums over every position of every datum (no mean, no mask: a position with
weight 0 or advantage 0 contributes nothing), with per-position inputs sent beside the tokens
(the Tinker documentation, "Loss functions"):
- `cross_entropy` (target_tokens, weights): -sum(weights * log p(target)).
- `importance_sampling` (target_tokens, logprobs, advantages): -sum(r * A), r = exp(log p - logprobs):
  rl/algos `ppo_clip` with the ratio bounds [0, inf) (nothing is clipped).
- `ppo` (same inputs; loss_fn_config clip_low_threshold / clip_high_threshold, ratio bounds, default
  0.8 / 1.2): -sum(min(r A, clip(r, lo, hi) A)) = `ppo_clip` with clip_low = 1 - lo, clip_high = hi - 1.
- `cispo` (same inputs and thresholds): gradient sum(sg(clip(r, lo, hi)) A grad log p) = rl/algos `cispo`.
  Its loss value is the clipped surrogate -sum(clip(r) A) (rl/algos writes it so); Tinker reports
  -sum(sg(clip(r)) A log p), which has the same gradient.
The sum is rl/algos' `reduce` with weight 1 on every real position (`compute_policy_loss(weights_BT=mask)`).

Refused, with the reason (`REFUSED`): `gspo` (its sequence ratio averages over the generated tokens, and
a Tinker datum does not say which positions were generated), `dro`, `stable_reinforce` (need the
service to record sampling state it does not keep) and `custom` (server-side custom losses).

What this module does not do: compute logprobs or step an optimizer (rl/tinker/models.py does).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from rl.algos.policy_loss import PolicyLossInputs, PolicyLossParams, compute_policy_loss

# Per loss: the loss_fn_inputs it needs (every one a 1-D tensor as long as the model input).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
# Optional inputs a datum may carry (cross_entropy without weights: every position weighs 1).
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {"cross_entropy": ("weights",)}
LOSS_CONFIG: dict[str, tuple[str, ...]] = {
    "cross_entropy": (), "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"), "cispo": ("clip_low_threshold", "clip_high_threshold"),
}
REFUSED: dict[str, str] = {
    "gspo": "its sequence-level ratio averages over the sampled tokens, and a Tinker datum does not mark which positions "
            "were sampled; use ppo or cispo",
    "dro": "not mapped onto rl/algos; use ppo, cispo or importance_sampling",
    "stable_reinforce": "needs sampling-time stability records this service does not keep",
    "custom": "server-side custom losses are not supported; use forward_backward_custom's client-side path",
}
DEFAULT_CLIP = (0.8, 1.2)  # ratio thresholds of ppo / cispo when loss_fn_config leaves them out


class LossRequestError(ValueError):
    """A loss name, config or input the service refuses (the caller answers 400)."""


def check_loss(name: str, config: Mapping[str, float | str]) -> None:
    """Refuse an unknown or refused loss and config keys it does not read, naming what is allowed."""
    if name in REFUSED:
        raise LossRequestError(f"loss_fn {name!r} is not supported by this service: {REFUSED[name]}")
    if name not in LOSS_INPUTS:
        raise LossRequestError(f"unknown loss_fn {name!r}; supported: {', '.join(LOSS_INPUTS)}")
    allowed = LOSS_CONFIG[name]
    for k, v in config.items():
        if k not in allowed:
            raise LossRequestError(f"loss_fn_config key {k!r} is not read by {name!r}; allowed: {list(allowed) or 'none'}")
        if not isinstance(v, float) or not v == v or v in (float("inf"), float("-inf")):
            raise LossRequestError(f"loss_fn_config[{k!r}] must be a finite number, got {v!r}")
    lo, hi = _thresholds(config)
    if not 0.0 <= lo <= 1.0 <= hi:
        raise LossRequestError(f"clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {lo}, {hi}")


def _thresholds(config: Mapping[str, float | str]) -> tuple[float, float]:
    return float(config.get("clip_low_threshold", DEFAULT_CLIP[0])), float(config.get("clip_high_threshold", DEFAULT_CLIP[1]))


def tinker_loss(name: str, logprobs_BT: Tensor, inputs_BT: Mapping[str, Tensor], mask_BT: Tensor,
                config: Mapping[str, float | str]) -> tuple[Tensor, Tensor]:
    """(the loss summed over the batch, the per-position loss [B, T] for the outputs) of loss `name`.

    `logprobs_BT`: log p(target_tokens) under the trained policy (with its graph); `inputs_BT`: the other
    loss inputs padded to [B, T]; `mask_BT`: 1 on real positions, 0 on padding."""
    mask = mask_BT > 0
    zero = torch.zeros((), dtype=logprobs_BT.dtype)
    if name == "cross_entropy":
        w_BT = inputs_BT.get("weights", mask.to(logprobs_BT.dtype))
        per_BT = torch.where(mask, -w_BT * logprobs_BT, zero)  # -w log p, summed (Tinker's definition)
        return per_BT.sum(), per_BT.detach()
    if name == "importance_sampling":
        params = PolicyLossParams(clip_low=1.0, clip_high=float("inf"))  # ratio in [0, inf): never clipped
        algo = "ppo_clip"
    else:
        lo, hi = _thresholds(config)
        params = PolicyLossParams(clip_low=1.0 - lo, clip_high=hi - 1.0)
        algo = "ppo_clip" if name == "ppo" else "cispo"
    pin = PolicyLossInputs(logprobs_BT=logprobs_BT, old_logprobs_BT=inputs_BT["logprobs"].to(logprobs_BT.dtype),
                           advantages_BT=inputs_BT["advantages"].to(logprobs_BT.dtype), mask_BT=mask)
    loss, _ = compute_policy_loss(algo, pin, params, weights_BT=mask.to(logprobs_BT.dtype))
    with torch.no_grad():  # per-position surrogate for the outputs: the same loss before the sum
        from rl.algos.policy_loss import POLICY_LOSSES

        per_BT, _ = POLICY_LOSSES.get(algo)(pin, params)
        per_BT = torch.where(mask, per_BT.detach(), zero)
    return loss, per_BT
