"""Router terms for RL on a Mixture-of-Experts policy: load-balance aux loss and router z-loss.

Load balance (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6; GShard, Lepikhin et al.
2020): per MoE layer, aux = E * sum_i f_i * P_i, where
  f_i = share of routing assignments that went to expert i (from the expert ids actually used —
        with routing replay (R3) these are the replayed routes the trainer's forward ran, not a fresh
        top-k of the trainer's logits); no gradient,
  P_i = mean over tokens of softmax(router_logits)_i; carries the gradient to the router.
Uniform routing gives aux = 1 with `count_per="assignment"` (sum_i f_i = 1, the Switch / Megatron
normalisation). `count_per="token"` makes sum_i f_i = top_k (uniform gives top_k): with
`layer_reduction="pooled"` (f and P pooled over all layers' tokens) that is exactly transformers'
Mixtral `load_balancing_loss_func` when given the top-k of the same logits.
Z-loss (ST-MoE, Zoph et al. 2022, arXiv:2202.08906, eq. 5): mean over tokens of logsumexp(logits)^2,
keeping router logits small so bf16 softmaxes stay accurate.

Defaults and why: public RL recipes for MoE mostly switch the aux loss off or make it very small during
RL, because pushing the router toward balance changes which experts fire and so the policy itself,
fighting the RL objective and destabilising training; routing replay plus importance correction handle
the train/inference routing mismatch instead. We keep the term available with a small default
coefficient (`ModelSection.router_aux_loss_coef = 0.001`; z-loss 0.0) and always log both values and the
load statistics, whatever the coefficients, so balance drift is visible.
What it does not do: aux-loss-free bias updates (that bias is frozen during RL), sigmoid-gated routers
(DeepSeek-V3 style scores would need their own P), or token dropping.
"""
from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

from rl.algos._common import check_mask, check_tensor

Metrics = dict[str, float]


def _stack(name: str, x: Tensor | Sequence[Tensor], trailing_ndim: int) -> Tensor:
    """Accept [L, N, X] or a per-layer sequence of [N, X] (what HF models return); give [L, N, X]."""
    if isinstance(x, torch.Tensor):
        check_tensor(name, x, trailing_ndim + 1)
        return x
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"{name}: expected a tensor [L, N, X] or a non-empty list/tuple of per-layer tensors [N, X], got {type(x).__name__}")
    for i, t in enumerate(x):
        check_tensor(f"{name}[{i}]", t, trailing_ndim)
        if t.shape != x[0].shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)} but {name}[0] has {tuple(x[0].shape)}")
    return torch.stack(list(x))


def _compute_dtype(logits: Tensor) -> torch.dtype:
    # bf16 router logits: softmax / logsumexp in fp32 (as MoE routers do); fp64 stays fp64
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _prepare(
    router_logits: Tensor | Sequence[Tensor], expert_ids: Tensor | Sequence[Tensor] | None, token_mask_N: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor]:
    logits_LNE = _stack("router_logits", router_logits, 2)
    if not logits_LNE.is_floating_point():
        raise TypeError(f"router_logits: expected floating point, got {logits_LNE.dtype}")
    L, N, E = logits_LNE.shape
    ids_LNK = None
    if expert_ids is not None:
        ids_LNK = _stack("expert_ids", expert_ids, 2)
        if ids_LNK.is_floating_point() or ids_LNK.dtype == torch.bool:
            raise TypeError(f"expert_ids: expected an integer tensor, got {ids_LNK.dtype}")
        if ids_LNK.shape[:2] != (L, N):
            raise ValueError(f"expert_ids has shape {tuple(ids_LNK.shape)}; expected [L={L}, N={N}, top_k] to match router_logits {tuple(logits_LNE.shape)}")
        if ids_LNK.numel() and (int(ids_LNK.min()) < 0 or int(ids_LNK.max()) >= E):
            raise ValueError(f"expert_ids out of range: found ids in [{int(ids_LNK.min())}, {int(ids_LNK.max())}] but there are {E} experts")
    if token_mask_N is None:
        mask_N = torch.ones(N, dtype=torch.bool, device=logits_LNE.device)
    else:
        mask_N = check_mask("token_mask_N", token_mask_N.reshape(-1), ndim=1)
        if mask_N.shape[0] != N:
            raise ValueError(f"token_mask_N has {mask_N.shape[0]} entries but router_logits has N={N} tokens per layer")
    return logits_LNE, ids_LNK, mask_N


def load_balance_loss(
    router_logits: Tensor | Sequence[Tensor],
    expert_ids: Tensor | Sequence[Tensor],
    token_mask_N: Tensor | None = None,
    *,
    count_per: Literal["assignment", "token"] = "assignment",
    layer_reduction: Literal["mean", "pooled"] = "mean",
) -> tuple[Tensor, Metrics]:
    """E * sum_i f_i * P_i from router logits [L, N, E] and the expert ids used [L, N, top_k].

    token_mask_N: 1 on real tokens (padding excluded); N = flattened batch*sequence positions.
    layer_reduction "mean": average of per-layer losses; "pooled": f and P over all layers' tokens at once.
    """
    if count_per not in ("assignment", "token"):
        raise ValueError(f"count_per={count_per!r}; allowed: 'assignment', 'token'")
    if layer_reduction not in ("mean", "pooled"):
        raise ValueError(f"layer_reduction={layer_reduction!r}; allowed: 'mean', 'pooled'")
    logits_LNE, ids_LNK, mask_N = _prepare(router_logits, expert_ids, token_mask_N)
    assert ids_LNK is not None
    L, N, E = logits_LNE.shape
    K = ids_LNK.shape[2]
    cdt = _compute_dtype(logits_LNE)
    w_N = mask_N.to(cdt)
    probs_LNE = torch.softmax(logits_LNE.to(cdt), dim=-1)
    # P_LE: mean router probability per expert over real tokens (where(): padding logits may be garbage)
    prob_sum_LE = torch.where(mask_N[None, :, None], probs_LNE, torch.zeros((), device=probs_LNE.device)).sum(dim=1)
    # counts_LE: how many of a layer's real-token assignments went to each expert (no gradient)
    counts_LE = torch.zeros(L, E, dtype=cdt, device=logits_LNE.device)
    counts_LE.scatter_add_(1, ids_LNK.reshape(L, N * K), w_N.repeat_interleave(K)[None, :].expand(L, N * K).contiguous())
    n_tok = w_N.sum().clamp(min=1)
    per = n_tok * (K if count_per == "assignment" else 1)
    if layer_reduction == "mean":
        f_LE = counts_LE / per
        P_LE = prob_sum_LE / n_tok
        aux = (E * (f_LE * P_LE).sum(dim=1)).mean()
    else:
        f_E = counts_LE.sum(0) / (per * L)
        P_E = prob_sum_LE.sum(0) / (n_tok * L)
        aux = E * (f_E * P_E).sum()
    with torch.no_grad():
        load_E = counts_LE.sum(0) / (n_tok * K * L) * E  # 1.0 = this expert got exactly its uniform share
        metrics: Metrics = {
            "router/aux_loss": float(aux),
            "router/max_load": float(load_E.max()),
            "router/min_load": float(load_E.min()),
            "router/unused_expert_frac": float((counts_LE.sum(0) == 0).float().mean()),
        }
    return aux, metrics


def router_z_loss(router_logits: Tensor | Sequence[Tensor], token_mask_N: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """ST-MoE z-loss: mean over layers and real tokens of logsumexp_i(logits_i)^2."""
    logits_LNE, _, mask_N = _prepare(router_logits, None, token_mask_N)
    lse_LN = torch.logsumexp(logits_LNE.to(_compute_dtype(logits_LNE)), dim=-1)
    sq_LN = torch.where(mask_N[None, :], lse_LN * lse_LN, torch.zeros((), device=lse_LN.device))
    z = sq_LN.sum() / (mask_N.sum().clamp(min=1) * logits_LNE.shape[0])
    return z, {"router/z_loss": float(z.detach())}


def router_losses(
    router_logits: Tensor | Sequence[Tensor],
    expert_ids: Tensor | Sequence[Tensor],
    token_mask_N: Tensor | None = None,
    *,
    aux_coef: float = 0.001,
    z_coef: float = 0.0,
    count_per: Literal["assignment", "token"] = "assignment",
    layer_reduction: Literal["mean", "pooled"] = "mean",
) -> tuple[Tensor, Metrics]:
    """aux_coef * load-balance loss + z_coef * z-loss, both always computed and logged.

    expert_ids: the routes the forward actually used ([L, N, top_k]; the replayed ones under R3).
    Defaults match `ModelSection` (aux 0.001, z 0): see the module docstring for why aux is small in RL.
    """
    if aux_coef < 0 or z_coef < 0:
        raise ValueError(f"aux_coef={aux_coef} and z_coef={z_coef} must be >= 0")
    aux, metrics = load_balance_loss(router_logits, expert_ids, token_mask_N, count_per=count_per, layer_reduction=layer_reduction)
    z, zm = router_z_loss(router_logits, token_mask_N)
    metrics.update(zm)
    total = aux_coef * aux + z_coef * z
    metrics["router/aux_coef"] = float(aux_coef)
    metrics["router/z_coef"] = float(z_coef)
    metrics["router/loss"] = float(total.detach())
    return total, metrics
