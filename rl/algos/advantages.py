"""Advantage estimators: outcome rewards (and optional per-token rewards) -> per-token advantages.

What it does: the estimators named by `AlgorithmSection.advantage` — `grpo`, `dr_grpo`, `rloo`,
`gae`, `reinforce_pp` — as small pure functions, plus a registry (`ADVANTAGES`) whose entries all take
the same typed inputs (`AdvantageInputs`, `AdvantageParams`) and return `(advantages_BT, metrics)`.
A second registry (`ADVANTAGE_TRANSFORMS`) holds what may be applied to the estimator's output over
the whole step batch before the loss: `whiten` (the `algorithm.whiten_advantages` switch).
What it does not do: compute values (the critic's forward is the trainer's), shape rewards (the
reward modules' job), filter zero-variance groups (see `dynamic_sampling`), decide when to whiten
(rl/objective.py reads the config switch).

Groups are explicit: `group_ids_B[i]` names the task whose G samples form sample i's baseline.
Multi-turn sequences: the time steps of the token-level estimators (`gae`, `reinforce_pp`) are the
policy's own tokens (`mask_BT == 1`). Prompt and tool-output tokens are not actions; discounting skips
them and their advantages are 0. The outcome reward sits on the last generated token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rl.algos._common import (
    check_float,
    check_ids,
    check_mask,
    check_same_shape,
    check_tensor,
    group_inverse,
    masked_sum,
    segment_sum,
    stats,
)
from rl.algos.registry import Registry

Metrics = dict[str, float]


# ----------------------------------------------------------------------------- typed inputs
@dataclass(frozen=True)
class AdvantageInputs:
    """What every registered estimator receives (tensors of one batch, B sequences, T positions)."""

    rewards_B: Tensor  # float [B]: outcome reward of each sequence
    mask_BT: Tensor  # [B, T]: 1 on policy-generated tokens
    group_ids_B: Tensor  # int [B]: samples with the same id share a baseline (one task's G samples)
    values_BT: Tensor | None = None  # float [B, T]: critic values V(s_t) at generated tokens (gae only)
    token_rewards_BT: Tensor | None = None  # float [B, T]: extra per-token rewards, e.g. -beta*KL folded in


@dataclass(frozen=True)
class AdvantageParams:
    """Estimator hyper-parameters; each estimator reads the ones it documents and ignores the rest."""

    norm_std: bool = True  # grpo: divide by the group's std (Dr. GRPO argues against it: difficulty bias)
    eps: float = 1e-6  # added to a std before dividing
    gamma: float = 1.0  # gae, reinforce_pp: discount per generated token
    lam: float = 1.0  # gae: GAE lambda
    batch_normalize: bool = True  # reinforce_pp: whiten over all generated tokens of the batch
    group_baseline: bool = False  # reinforce_pp: subtract the group mean reward first ("REINFORCE++-baseline")


AdvantageFn = Callable[[AdvantageInputs, AdvantageParams], "tuple[Tensor, Metrics]"]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def compute_advantages(name: str, inputs: AdvantageInputs, params: AdvantageParams | None = None) -> tuple[Tensor, Metrics]:
    """Run the estimator registered as `name`; returns (advantages_BT (0 off the mask), metrics)."""
    return ADVANTAGES.get(name)(inputs, params or AdvantageParams())


# ----------------------------------------------------------------------------- checks & helpers
def _check_rewards(rewards_B: Tensor) -> Tensor:
    check_tensor("rewards_B", rewards_B, 1)
    check_float("rewards_B", rewards_B)
    if not bool(torch.isfinite(rewards_B).all()):
        bad = torch.nonzero(~torch.isfinite(rewards_B)).flatten()[:5].tolist()
        raise ValueError(f"rewards_B: non-finite rewards at indices {bad}; a failed grade must be handled before the math, not turned into NaN")
    return rewards_B


def broadcast_to_tokens(adv_B: Tensor, mask_BT: Tensor) -> Tensor:
    """adv_B [B] -> adv_BT [B, T]: the sequence's advantage on each generated token, 0 elsewhere."""
    mask = check_mask("mask_BT", mask_BT)
    if adv_B.shape != mask.shape[:1]:
        raise ValueError(f"adv_B has shape {tuple(adv_B.shape)} but mask_BT has {mask.shape[0]} rows")
    return torch.where(mask, adv_B[:, None], torch.zeros((), dtype=adv_B.dtype, device=adv_B.device))


def last_token_index(mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(index_B of the last generated token of each row, has_tokens_B). Rows without tokens give index 0."""
    mask = check_mask("mask_BT", mask_BT)
    T = mask.shape[1]
    flipped_first = torch.argmax(mask.flip(1).to(torch.int8), dim=1)  # first True from the right
    return T - 1 - flipped_first, mask.any(dim=1)


def outcome_to_token_rewards(rewards_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Place each sequence's outcome reward on its last generated token: rewards_BT [B, T]."""
    mask = check_mask("mask_BT", mask_BT)
    idx_B, has_B = last_token_index(mask)
    out_BT = torch.zeros(mask.shape, dtype=rewards_B.dtype, device=rewards_B.device)
    rows = torch.arange(mask.shape[0], device=mask.device)
    out_BT[rows[has_B], idx_B[has_B]] = rewards_B[has_B]
    return out_BT


def _sequence_rewards(inputs: AdvantageInputs, mask: Tensor) -> Tensor:
    """Outcome reward plus the sum of any per-token rewards (the undiscounted return of the sequence)."""
    r_B = _check_rewards(inputs.rewards_B)
    if inputs.token_rewards_BT is not None:
        check_same_shape(mask_BT=mask, token_rewards_BT=inputs.token_rewards_BT)
        r_B = r_B + masked_sum(inputs.token_rewards_BT, mask, dim=1)
    return r_B


# ----------------------------------------------------------------------------- group baselines
def grpo_advantages_B(rewards_B: Tensor, group_ids_B: Tensor, *, norm_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Metrics]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): A_i = (r_i - mean_g) / (std_g + eps).

    std is the sample std (Bessel-corrected, as torch.std, TRL and verl use); a group of one sample
    has std 0 and advantage 0. With norm_std=False this is Dr. GRPO's advantage (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", arXiv:2503.20783): A_i = r_i - mean_g.
    """
    _check_rewards(rewards_B)
    check_ids("group_ids_B", group_ids_B, rewards_B.shape[0])
    inv_B, n = group_inverse(group_ids_B)
    ones_B = torch.ones_like(rewards_B)
    count_G = segment_sum(ones_B, inv_B, n)
    mean_G = segment_sum(rewards_B, inv_B, n) / count_G
    centered_B = rewards_B - mean_G[inv_B]
    var_G = segment_sum(centered_B * centered_B, inv_B, n) / (count_G - 1).clamp(min=1)
    std_G = var_G.sqrt()
    if not eps >= 0:
        raise ValueError(f"eps={eps} must be >= 0")
    denom_B = std_G[inv_B] + eps
    # a zero-variance group has centered == 0: keep 0 even with eps == 0 (no 0/0)
    adv_B = torch.where(denom_B > 0, centered_B / denom_B.clamp(min=torch.finfo(denom_B.dtype).tiny), centered_B) if norm_std else centered_B
    metrics = {
        "adv/num_groups": float(n),
        "adv/zero_std_group_frac": float((std_G == 0).float().mean()),
        **stats("adv/reward", rewards_B),
        **stats("adv/group_std", std_G),
    }
    return adv_B, metrics


def rloo_advantages_B(rewards_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Metrics]:
    """RLOO (Kool et al. 2019 "Buy 4 REINFORCE samples..."; Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = r_i - mean_{j != i, j in g} r_j = G/(G-1) * (r_i - mean_g). A group of one sample has no
    leave-one-out baseline; its advantage is 0 (it carries no comparative signal).
    """
    _check_rewards(rewards_B)
    check_ids("group_ids_B", group_ids_B, rewards_B.shape[0])
    inv_B, n = group_inverse(group_ids_B)
    count_G = segment_sum(torch.ones_like(rewards_B), inv_B, n)
    sum_G = segment_sum(rewards_B, inv_B, n)
    others_B = count_G[inv_B] - 1
    baseline_B = (sum_G[inv_B] - rewards_B) / others_B.clamp(min=1)
    adv_B = torch.where(others_B > 0, rewards_B - baseline_B, torch.zeros_like(rewards_B))
    metrics = {"adv/num_groups": float(n), "adv/singleton_groups": float((count_G == 1).sum()), **stats("adv/reward", rewards_B)}
    return adv_B, metrics


# ----------------------------------------------------------------------------- token-level returns
def _compress(mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Pack each row's generated positions to the left: (order_BT, valid_BN, N = max generated count).

    order_BT[b, k] for k < n_b is the position of row b's k-th generated token (then the others).
    """
    order_BT = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    n_B = mask.sum(dim=1)
    N = int(n_B.max()) if mask.numel() else 0
    valid_BN = torch.arange(N, device=mask.device)[None, :] < n_B[:, None]
    return order_BT, valid_BN, N


def _discounted_reverse_cumsum(x_BN: Tensor, c: float, chunk: int = 64) -> Tensor:
    """y_k = sum_{l >= k} c^(l-k) x_l along dim 1, in chunks: a [chunk, chunk] matmul inside each chunk,
    and a carry c^(distance) * y(first index of the next chunk) across chunks (N/chunk Python steps
    instead of N; no c^-k factors, so nothing overflows for long sequences)."""
    B, N = x_BN.shape
    if N == 0:
        return x_BN.clone()
    k = torch.arange(chunk, device=x_BN.device, dtype=x_BN.dtype)
    diff_CC = k[None, :] - k[:, None]  # l - k
    U_CC = torch.where(diff_CC >= 0, torch.pow(torch.tensor(c, dtype=x_BN.dtype, device=x_BN.device), diff_CC.clamp(min=0)), torch.zeros((), dtype=x_BN.dtype, device=x_BN.device))
    carry_pow_C = torch.pow(torch.tensor(c, dtype=x_BN.dtype, device=x_BN.device), chunk - k)  # c^(next_start - k)
    pad = (-N) % chunk
    x_BM = torch.nn.functional.pad(x_BN, (0, pad))
    M = x_BM.shape[1]
    y_BM = torch.empty_like(x_BM)
    carry_B = torch.zeros(B, dtype=x_BN.dtype, device=x_BN.device)  # y at the first index of the next chunk
    for s in range(M - chunk, -1, -chunk):
        y_BC = x_BM[:, s : s + chunk] @ U_CC.T + carry_B[:, None] * carry_pow_C[None, :]
        y_BM[:, s : s + chunk] = y_BC
        carry_B = y_BC[:, 0]
    return y_BM[:, :N]


def _reverse_scan(rewards_BT: Tensor, values_BT: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE over generated tokens only: A_k = sum_l (gamma*lam)^l delta_{k+l}, k indexing generated tokens.

    delta_k = r_k + gamma*V_{k+1} - V_k; after the last generated token V = 0 (the episode is over).
    Prompt / tool-output / padding positions are not time steps: the row is packed to its generated
    tokens, solved, and scattered back (0 elsewhere). values 0 and lam 1 give discounted returns.
    """
    order_BT, valid_BN, N = _compress(mask)
    zero = torch.zeros((), dtype=rewards_BT.dtype, device=rewards_BT.device)
    idx_BN = order_BT[:, :N]
    r_BN = torch.where(valid_BN, torch.gather(rewards_BT, 1, idx_BN), zero)
    v_BN = torch.where(valid_BN, torch.gather(values_BT, 1, idx_BN), zero)
    next_v_BN = torch.nn.functional.pad(v_BN[:, 1:], (0, 1))  # 0 after the last generated token
    delta_BN = torch.where(valid_BN, r_BN + gamma * next_v_BN - v_BN, zero)
    adv_BN = torch.where(valid_BN, _discounted_reverse_cumsum(delta_BN, gamma * lam), zero)
    return torch.zeros_like(rewards_BT).scatter(1, idx_BN, adv_BN)


def _check_gamma_lam(gamma: float, lam: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in [0, 1]")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam={lam} must be in [0, 1]")


def gae_advantages_BT(token_rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Metrics]:
    """GAE (Schulman et al. 2016, arXiv:1506.02438) over the generated tokens of each row.

    Returns advantages_BT (0 off the mask). The critic's regression target is
    returns_BT = advantages_BT + values_BT (on the mask), see `gae_returns_BT`.
    """
    mask = check_mask("mask_BT", mask_BT)
    check_same_shape(mask_BT=mask, token_rewards_BT=token_rewards_BT, values_BT=values_BT)
    check_float("token_rewards_BT", token_rewards_BT)
    check_float("values_BT", values_BT)
    _check_gamma_lam(gamma, lam)
    adv_BT = _reverse_scan(token_rewards_BT, values_BT.detach(), mask, gamma, lam)
    metrics = {**stats("adv", adv_BT, mask), **stats("adv/value", values_BT, mask)}
    return adv_BT, metrics


def gae_returns_BT(advantages_BT: Tensor, values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Value targets for the critic: A_t + V(s_t) on generated tokens, 0 elsewhere (detached)."""
    mask = check_mask("mask_BT", mask_BT)
    check_same_shape(mask_BT=mask, advantages_BT=advantages_BT, values_BT=values_BT)
    return torch.where(mask, advantages_BT + values_BT, torch.zeros((), dtype=values_BT.dtype, device=values_BT.device)).detach()


def whiten(x_BT: Tensor, mask_BT: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch (population std); 0 off the mask."""
    mask = check_mask("mask_BT", mask_BT)
    n = mask.sum().clamp(min=1)
    mean = masked_sum(x_BT, mask) / n
    var = masked_sum((x_BT - mean) ** 2, mask) / n
    return torch.where(mask, (x_BT - mean) / (var.sqrt() + eps), torch.zeros((), dtype=x_BT.dtype, device=x_BT.device))


AdvantageTransformFn = Callable[[Tensor, Tensor], "tuple[Tensor, Metrics]"]
ADVANTAGE_TRANSFORMS: Registry[AdvantageTransformFn] = Registry("advantage transform")


@ADVANTAGE_TRANSFORMS.register("whiten")
def whiten_advantages(advantages_BT: Tensor, mask_BT: Tensor, eps: float = 1e-8) -> tuple[Tensor, Metrics]:
    """Advantage whitening as PPO implementations apply it to GAE advantages before the loss:
    (A - mean) / sqrt(var + eps), mean and Bessel-corrected variance over every generated token of the
    batch, 0 off the mask (verl's `masked_whiten` with shift_mean, applied by its GAE estimator; OpenRLHF
    and TRL's former PPOTrainer whiten GAE advantages the same way). Call it on the whole step batch,
    never per micro-batch: the statistics are the batch's. One token (or none) has no variance: its
    advantage becomes 0. Returns (whitened_BT, metrics with the statistics used).
    """
    mask = check_mask("mask_BT", mask_BT)
    check_float("advantages_BT", check_tensor("advantages_BT", advantages_BT, 2))
    check_same_shape(mask_BT=mask, advantages_BT=advantages_BT)
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")
    n = mask.sum()
    mean = masked_sum(advantages_BT, mask) / n.clamp(min=1)
    zero = torch.zeros((), dtype=advantages_BT.dtype, device=advantages_BT.device)
    centered_BT = torch.where(mask, advantages_BT - mean, zero)
    var = (centered_BT * centered_BT).sum() / (n - 1).clamp(min=1)
    out_BT = torch.where(mask, centered_BT * torch.rsqrt(var + eps), zero)
    return out_BT, {"adv/whiten/mean": float(mean), "adv/whiten/std": float(var.sqrt())}


def reinforce_pp_advantages_BT(
    rewards_B: Tensor,
    mask_BT: Tensor,
    *,
    token_rewards_BT: Tensor | None = None,
    group_ids_B: Tensor | None = None,
    gamma: float = 1.0,
    batch_normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Metrics]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    Token rewards = outcome reward on the last generated token (minus the group mean when
    group_ids_B is given: the "REINFORCE++-baseline" variant) + token_rewards_BT (e.g. -beta*KL).
    G_t = sum over later generated tokens s of gamma^(steps from t to s) * r_s. Then, if
    batch_normalize, (G - mean) / (std + eps) over every generated token of the batch.
    """
    mask = check_mask("mask_BT", mask_BT)
    _check_rewards(rewards_B)
    _check_gamma_lam(gamma, 1.0)
    r_B = rewards_B
    metrics: Metrics = {}
    if group_ids_B is not None:
        r_B, m = grpo_advantages_B(rewards_B, group_ids_B, norm_std=False)
        metrics["adv/num_groups"] = m["adv/num_groups"]
    rewards_BT = outcome_to_token_rewards(r_B, mask)
    if token_rewards_BT is not None:
        check_same_shape(mask_BT=mask, token_rewards_BT=token_rewards_BT)
        rewards_BT = rewards_BT + torch.where(mask, token_rewards_BT, torch.zeros_like(token_rewards_BT))
    returns_BT = _reverse_scan(rewards_BT, torch.zeros_like(rewards_BT), mask, gamma, 1.0)
    adv_BT = whiten(returns_BT, mask, eps) if batch_normalize else returns_BT
    metrics.update(stats("adv/return", returns_BT, mask))
    metrics.update(stats("adv/reward", rewards_B))
    return adv_BT, metrics


# ----------------------------------------------------------------------------- registry entries
def _outcome_inputs(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    mask = check_mask("mask_BT", inputs.mask_BT)
    r_B = _sequence_rewards(inputs, mask)
    if r_B.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards_B has {r_B.shape[0]} entries but mask_BT has {mask.shape[0]} rows")
    return r_B, mask


def _finish(adv_BT: Tensor, mask: Tensor, metrics: Metrics) -> tuple[Tensor, Metrics]:
    metrics.update(stats("adv", adv_BT, mask))
    metrics["adv/empty_rows"] = float((~mask.any(dim=1)).sum())
    return adv_BT, metrics


@ADVANTAGES.register("grpo")
def _grpo(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Metrics]:
    """GRPO; per-token rewards, if any, are summed into the sequence reward. Reads norm_std, eps."""
    r_B, mask = _outcome_inputs(inputs)
    adv_B, m = grpo_advantages_B(r_B, inputs.group_ids_B, norm_std=params.norm_std, eps=params.eps)
    return _finish(broadcast_to_tokens(adv_B, mask), mask, m)


@ADVANTAGES.register("dr_grpo")
def _dr_grpo(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Metrics]:
    """Dr. GRPO: group-mean baseline, no std division (pair with a length-free aggregation)."""
    r_B, mask = _outcome_inputs(inputs)
    adv_B, m = grpo_advantages_B(r_B, inputs.group_ids_B, norm_std=False)
    return _finish(broadcast_to_tokens(adv_B, mask), mask, m)


@ADVANTAGES.register("rloo")
def _rloo(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Metrics]:
    r_B, mask = _outcome_inputs(inputs)
    adv_B, m = rloo_advantages_B(r_B, inputs.group_ids_B)
    return _finish(broadcast_to_tokens(adv_B, mask), mask, m)


@ADVANTAGES.register("gae")
def _gae(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Metrics]:
    """GAE with a critic; needs values_BT. Reads gamma, lam."""
    if inputs.values_BT is None:
        raise ValueError("advantage estimator 'gae' needs AdvantageInputs.values_BT (critic values); got None")
    mask = check_mask("mask_BT", inputs.mask_BT)
    _check_rewards(inputs.rewards_B)
    rewards_BT = outcome_to_token_rewards(inputs.rewards_B, mask)
    if inputs.token_rewards_BT is not None:
        check_same_shape(mask_BT=mask, token_rewards_BT=inputs.token_rewards_BT)
        rewards_BT = rewards_BT + torch.where(mask, inputs.token_rewards_BT, torch.zeros_like(inputs.token_rewards_BT))
    adv_BT, m = gae_advantages_BT(rewards_BT, inputs.values_BT, mask, gamma=params.gamma, lam=params.lam)
    return _finish(adv_BT, mask, m)


@ADVANTAGES.register("reinforce_pp")
def _reinforce_pp(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[Tensor, Metrics]:
    """REINFORCE++; reads gamma, batch_normalize, group_baseline, eps."""
    mask = check_mask("mask_BT", inputs.mask_BT)
    adv_BT, m = reinforce_pp_advantages_BT(
        inputs.rewards_B,
        mask,
        token_rewards_BT=inputs.token_rewards_BT,
        group_ids_B=inputs.group_ids_B if params.group_baseline else None,
        gamma=params.gamma,
        batch_normalize=params.batch_normalize,
        eps=params.eps,
    )
    return _finish(adv_BT, mask, m)
