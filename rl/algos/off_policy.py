"""Train/inference mismatch correction: the rollout engine's logprobs vs the trainer's old-policy logprobs.

Why: vLLM samples with its own kernels (and, for MoE, possibly different expert choices), so the
distribution that produced the tokens, pi_rollout, is not exactly the trainer's pi_old even at the same
weights. The policy-gradient estimate is then off-policy; importance weights
rho = pi_old / pi_rollout correct it, and capping or masking keeps their variance bounded.

- Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", fengyao.notion.site): w = min(rho, cap), multiplied into each token's policy
  loss (`PolicyLossInputs.is_weights_BT`). Levels: `token` (rho_t), `sequence` (prod_t rho_t, one
  weight per sequence), `geometric` (exp(mean_t log rho_t), the length-normalised sequence ratio).
- Masked importance sampling (MIS; Liu et al. 2025, "When Speed Kills Stability: Demystifying RL
  Collapse from the Training-Inference Mismatch"; verl's rollout correction "mask" mode): tokens (or whole
  sequences) whose rho is outside [low, high] are dropped from the loss mask instead of reweighted.
Both report the fraction capped / masked and the mismatch size (k3 estimate of KL(pi_rollout || pi_old)).
What it does not do: compute either logprob (the engine and the trainer do).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from rl.algos._common import check_float, check_mask, check_same_shape, check_tensor, masked_mean, masked_sum, stats

Metrics = dict[str, float]
Level = Literal["token", "sequence", "geometric"]
_LEVELS = ("token", "sequence", "geometric")


def _log_rho(old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor, level: str) -> tuple[Tensor, Tensor, Tensor]:
    """(mask bool, log_rho_BT per token (0 off mask), log weight at the chosen level broadcast to [B, T])."""
    if level not in _LEVELS:
        raise ValueError(f"level={level!r} is not one of {_LEVELS}")
    mask = check_mask("mask_BT", mask_BT)
    check_float("old_logprobs_BT", check_tensor("old_logprobs_BT", old_logprobs_BT, 2))
    check_float("rollout_logprobs_BT", check_tensor("rollout_logprobs_BT", rollout_logprobs_BT, 2))
    check_same_shape(mask_BT=mask, old_logprobs_BT=old_logprobs_BT, rollout_logprobs_BT=rollout_logprobs_BT)
    zero = torch.zeros((), dtype=old_logprobs_BT.dtype, device=old_logprobs_BT.device)
    log_rho_BT = torch.where(mask, old_logprobs_BT.detach() - rollout_logprobs_BT.detach(), zero)
    if level == "token":
        return mask, log_rho_BT, log_rho_BT
    seq_B = log_rho_BT.sum(dim=1)
    if level == "geometric":
        seq_B = seq_B / mask.sum(dim=1).clamp(min=1).to(seq_B.dtype)
    return mask, log_rho_BT, seq_B[:, None].expand(mask.shape)


@torch.no_grad()
def _mismatch_metrics(log_rho_BT: Tensor, mask: Tensor) -> Metrics:
    rho = torch.exp(log_rho_BT.clamp(max=50.0))
    m = stats("offpolicy/token_rho", rho, mask)
    # log rho = log pi_old - log pi_rollout on tokens sampled from pi_rollout: k3 = rho - 1 - log rho
    m["offpolicy/mismatch_kl_k3"] = float(masked_mean(rho - 1 - log_rho_BT, mask))
    m["offpolicy/mismatch_kl_k1"] = float(masked_mean(-log_rho_BT, mask))
    return m


def _unit_frac(flags_BT: Tensor, mask: Tensor, level: str) -> float:
    """Fraction of tokens (token level) or of non-empty sequences (sequence levels) that are flagged."""
    if level == "token":
        return float(masked_mean(flags_BT.float(), mask))
    has_B = mask.any(dim=1)
    seq_flag_B = (flags_BT & mask).any(dim=1)  # a sequence-level flag is the same on all its tokens
    return float(seq_flag_B[has_B].float().mean()) if bool(has_B.any()) else 0.0


@torch.no_grad()
def truncated_is_weights(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    cap: float = 2.0,
    level: Level = "token",
) -> tuple[Tensor, Metrics]:
    """TIS weights_BT = min(rho, cap) at `level` (0 off the mask; no gradient). cap must be > 0."""
    if not cap > 0:
        raise ValueError(f"cap={cap} must be > 0 (to disable TIS, do not apply weights)")
    mask, log_rho_BT, log_w_BT = _log_rho(old_logprobs_BT, rollout_logprobs_BT, mask_BT, level)
    log_cap = math.log(cap)
    capped_BT = log_w_BT > log_cap
    # exp(min(log w, log cap)): a product of thousands of token ratios must not overflow before the cap.
    w_BT = torch.where(mask, torch.exp(log_w_BT.clamp(max=log_cap)), torch.zeros((), dtype=log_w_BT.dtype, device=log_w_BT.device))
    metrics = _mismatch_metrics(log_rho_BT, mask)
    metrics["offpolicy/tis_capped_frac"] = _unit_frac(capped_BT & mask, mask, level)
    metrics.update(stats("offpolicy/tis_weight", w_BT, mask))
    return w_BT, metrics


@torch.no_grad()
def masked_is_mask(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: Level = "token",
) -> tuple[Tensor, Metrics]:
    """MIS: the loss mask with tokens (or whole sequences) whose rho is outside [low, high] removed.

    Returns (new_mask_BT bool, metrics). Use the new mask for the policy loss and its aggregation.
    """
    if not 0 < low <= 1 <= high:
        raise ValueError(f"need 0 < low <= 1 <= high, got low={low}, high={high}")
    mask, log_rho_BT, log_w_BT = _log_rho(old_logprobs_BT, rollout_logprobs_BT, mask_BT, level)
    outside_BT = (log_w_BT < math.log(low)) | (log_w_BT > math.log(high))
    new_mask_BT = mask & ~outside_BT
    metrics = _mismatch_metrics(log_rho_BT, mask)
    metrics["offpolicy/mis_masked_frac"] = _unit_frac(outside_BT & mask, mask, level)
    metrics["offpolicy/mis_masked_token_frac"] = float(masked_sum((outside_BT & mask).float(), mask) / mask.sum().clamp(min=1))
    return new_mask_BT, metrics
