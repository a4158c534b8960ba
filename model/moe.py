"""The routed MoE FFN: router, batched expert dispatch, shared expert, load-balance terms, routing replay.

Block (parameter names and function of transformers' `Qwen3NextSparseMoeBlock` when `scoring_func="softmax"` and
the selection bias is zero):
    logits = x W_r^T                                        `gate.weight` [E, D]
    s      = softmax(logits) | sigmoid(logits)              `scoring_func` (DeepSeek-V3's name)
    idx    = top-k(s + b)   (b: aux-loss-free selection bias, `gate.e_score_correction_bias`, a buffer; selection only)
    w      = s[idx] (/ sum, if norm_topk_prob) * routed_scaling_factor
    y      = sum_k w_k FFN_{idx_k}(x) + sigmoid(x W_sg^T) * FFN_shared(x)
FFN_e(x) = down_e(SiLU(gate_e x) * up_e x) with experts fused in memory: `experts.gate_up_proj` [E, 2M, D]
(rows [gate | up]) and `experts.down_proj` [E, D, M] (transformers-5 layout).

Dispatch: one stable argsort groups the (token, slot) pairs by expert; each expert runs two dense matmuls on its
contiguous slice; one `index_add_` scatters back. There is no Python loop over tokens (only over experts).

Load-balance terms, returned separately (the trainer weights and logs them):
  (a) `switch_aux_loss`: E * sum_i f_i P_i  (Switch Transformer eq. 4-6 / GShard), pooled over layers exactly as
      transformers' Mixtral `load_balancing_loss_func` (f_i counts top-k assignments per token row, so uniform
      routing gives ~top_k);
  (b) `router_z_loss`: mean over tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022, eq. 5);
  (c) aux-loss-free bias (DeepSeek-V3 §2.1.2, Wang et al. 2024 "Auxiliary-Loss-Free Load Balancing"):
      b_i += u * sign(mean_j load_j - load_i), applied by `update_expert_bias`, not by autograd.
Routing replay (R3, "rollout routing replay"): given recorded `idx`, the top-k is skipped and w is recomputed from
the current router scores at those indices, so the router still gets a gradient.

What this module does not do: expert parallelism / all-to-all, capacity dropping, or the all-reduce of load
counts across data-parallel ranks before a bias update (the trainer does that; see `expert_bias_step`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True)
class MoeLayerRecord:
    """What one MoE layer reports for one forward (N = tokens = B*T, flattened row-major)."""

    router_logits_NE: torch.Tensor  # raw router logits (with grad)
    scores_NE: torch.Tensor  # softmax / sigmoid scores (with grad)
    selected_NK: torch.Tensor  # chosen expert ids (long, no grad)
    load_E: torch.Tensor  # float count of top-k assignments per expert over valid tokens (no grad)


# ----------------------------------------------------------------------------- pure functions
def route(logits_NE: torch.Tensor, top_k: int, scoring_func: str = "softmax", norm_topk_prob: bool = True,
          bias_E: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
          replay_idx_NK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (scores_NE, idx_NK, weights_NK). `bias_E` shifts the selection only; `replay_idx_NK` replaces it."""
    if scoring_func == "softmax":
        scores = torch.softmax(logits_NE.float(), dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits_NE.float())
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    if replay_idx_NK is not None:
        if replay_idx_NK.shape != (logits_NE.shape[0], top_k):
            raise ValueError(f"replayed routes must be [tokens={logits_NE.shape[0]}, k={top_k}], got {tuple(replay_idx_NK.shape)}")
        if replay_idx_NK.numel() and (replay_idx_NK.min() < 0 or replay_idx_NK.max() >= logits_NE.shape[-1]):
            raise ValueError(f"replayed expert ids must be in [0, {logits_NE.shape[-1]}), got range "
                             f"[{int(replay_idx_NK.min())}, {int(replay_idx_NK.max())}]")
        idx = replay_idx_NK.to(device=logits_NE.device, dtype=torch.long)
    else:
        with torch.no_grad():
            sel = scores if bias_E is None else scores + bias_E.float()
            idx = sel.topk(top_k, dim=-1).indices
    w = scores.gather(-1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if scoring_func == "sigmoid" else 0.0))
    return scores, idx, (w * routed_scaling_factor).to(logits_NE.dtype)


def grouped_expert_ffn(x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor, gate_up_E2MD: torch.Tensor,
                       down_EDM: torch.Tensor) -> torch.Tensor:
    """sum_k w[n,k] * FFN_{idx[n,k]}(x[n]) with tokens grouped per expert (sort, slice, matmul, scatter-add)."""
    N, D = x_ND.shape
    E, M = gate_up_E2MD.shape[0], down_EDM.shape[-1]
    K = idx_NK.shape[-1]
    flat_e = idx_NK.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    token_of = order // K  # which token each sorted (token, slot) pair came from
    counts = torch.bincount(flat_e, minlength=E).tolist()  # one host sync per layer
    x_sorted = x_ND.index_select(0, token_of)
    # split / unbind (not per-expert slicing or indexing): their backward is one cat / stack, whereas the backward
    # of each slice or index would materialise a full-size zero gradient per expert (O(E * size) memory traffic).
    segs = x_sorted.split(counts, dim=0)
    gate_up, down = gate_up_E2MD.unbind(0), down_EDM.unbind(0)
    # the gate weight scales the M-wide activation before the down projection (linear, so equal; half the work
    # of scaling the D-wide output when M < D)
    w_segs = w_NK.reshape(-1).index_select(0, order).to(x_ND.dtype).split(counts, dim=0)
    outs = []
    for e, n in enumerate(counts):
        if n == 0:
            continue
        g, u = (segs[e] @ gate_up[e].t()).split(M, dim=-1)
        outs.append((F.silu(g) * u * w_segs[e][:, None]) @ down[e].t())
    y_sorted = torch.cat(outs, 0) if outs else x_ND.new_zeros(0, D)
    return x_ND.new_zeros(N, D).index_add_(0, token_of, y_sorted.to(x_ND.dtype))


def switch_aux_loss(scores: list[torch.Tensor], selected: list[torch.Tensor], num_experts: int,
                    token_mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """E * sum_i f_i P_i pooled over layers (rows of all layers together), as Mixtral's load_balancing_loss_func:
    f_i = (# top-k assignments to i) / rows, P_i = mean router probability of i. `scores` are per-token
    distributions (softmax; for sigmoid scoring pass scores normalised to sum 1)."""
    if not scores:
        raise ValueError("switch_aux_loss needs at least one layer")
    dev = scores[0].device
    counts = torch.zeros(num_experts, device=dev)
    prob_sum = torch.zeros(num_experts, device=dev)
    rows = torch.zeros((), device=dev)
    m = None if token_mask_N is None else token_mask_N.reshape(-1).float().to(dev)
    for s_NE, idx_NK in zip(scores, selected):
        K = idx_NK.shape[-1]
        wts = torch.ones(idx_NK.numel(), device=dev) if m is None else m.repeat_interleave(K)
        counts = counts + torch.zeros(num_experts, device=dev).scatter_add_(0, idx_NK.reshape(-1), wts)
        prob_sum = prob_sum + (s_NE.float() if m is None else s_NE.float() * m[:, None]).sum(0)
        rows = rows + (s_NE.shape[0] if m is None else m.sum())
    rows = rows.clamp_min(1)
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(logits: list[torch.Tensor], token_mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """mean over layers and valid tokens of logsumexp(logits)^2 (ST-MoE)."""
    if not logits:
        raise ValueError("router_z_loss needs at least one layer")
    total, rows = 0.0, 0.0
    for l_NE in logits:
        z2 = torch.logsumexp(l_NE.float(), dim=-1).square()
        if token_mask_N is None:
            total, rows = total + z2.sum(), rows + z2.numel()
        else:
            m = token_mask_N.reshape(-1).float()
            total, rows = total + (z2 * m).sum(), rows + m.sum()
    return total / torch.as_tensor(rows).clamp_min(1)


def expert_bias_step(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free update: raise the bias of under-loaded experts, lower over-loaded, by `rate`."""
    return bias_E + rate * torch.sign(load_E.float().mean() - load_E.float()).to(bias_E.dtype)


# ----------------------------------------------------------------------------- modules
class DenseMLP(nn.Module):
    """SwiGLU MLP with Qwen names (gate_proj, up_proj, down_proj): shared expert and `mlp_only_layers`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        E = config.num_experts
        self.weight = nn.Parameter(torch.zeros(E, config.hidden_size))
        # Buffers, not parameters: ZeRO partitions only parameters, and autograd must not touch them.
        self.register_buffer("e_score_correction_bias", torch.zeros(E), persistent=True)
        self.register_buffer("load_accum", torch.zeros(E), persistent=False)  # loads since the last bias update

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        # Parameters are used only inside their own module's forward, so ZeRO-3's per-module gathering sees them.
        return F.linear(x_ND, self.weight)


class Experts(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        E, M, D = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * M, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, M))

    def forward(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        return grouped_expert_ffn(x_ND, idx_NK, w_NK, self.gate_up_proj, self.down_proj)


class SparseMoeBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.scoring_func, self.norm_topk_prob = config.scoring_func, config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = Router(config)
        self.experts = Experts(config)
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x_BTD: torch.Tensor, replay_idx_NK: torch.Tensor | None = None,
                token_mask_N: torch.Tensor | None = None) -> tuple[torch.Tensor, MoeLayerRecord]:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        logits_NE = self.gate(x_ND)
        scores, idx, w = route(logits_NE, self.top_k, self.scoring_func, self.norm_topk_prob,
                               self.gate.e_score_correction_bias, self.routed_scaling_factor, replay_idx_NK)
        y_ND = self.experts(x_ND, idx, w)
        if self.shared_expert is not None:
            y_ND = y_ND + torch.sigmoid(self.shared_expert_gate(x_ND)) * self.shared_expert(x_ND)
        with torch.no_grad():
            wts = None if token_mask_N is None else token_mask_N.reshape(-1, 1).expand_as(idx).reshape(-1).float()
            load_E = torch.bincount(idx.reshape(-1), weights=wts, minlength=self.num_experts).float()
            if self.training:
                self.gate.load_accum += load_E
        return y_ND.view(B, T, D), MoeLayerRecord(logits_NE, scores, idx, load_E)

    @torch.no_grad()
    def update_expert_bias(self, rate: float, load_E: torch.Tensor | None = None) -> None:
        """Apply one aux-loss-free bias step from `load_E` (default: loads accumulated since the last step)."""
        load = self.gate.load_accum if load_E is None else load_E.to(self.gate.load_accum)
        self.gate.e_score_correction_bias.copy_(expert_bias_step(self.gate.e_score_correction_bias, load, rate))
        self.gate.load_accum.zero_()
