"""Gated Delta attention ("Delta Attention" in the seed articles): the math and the layer.

The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", arXiv:2412.06464), per head, with
L2-normalised q_t, k_t, write strength beta_t in (0, 1) and log-decay g_t <= 0:

    S_t = exp(g_t) * S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        (S_t: [dv, dk])
    o_t = S_t q_t

Storage convention (shared with transformers' Qwen3-Next, FLA and vLLM, so states can be exchanged): the state
tensor is kept transposed, `state_BHKV[b, h] = S^T` of shape [dk, dv]; then `o_t = state^T q_t` and
`state_t = (I - beta k k^T) exp(g) state_{t-1} + beta k v^T`.

Public pure functions (tensors in, tensors out; no normalisation or scaling inside — the layer does it):
  - `chunk_gated_delta_rule`: chunk-parallel form for training / prefill (WY / UT-transform within a chunk,
    sequential over chunks).
  - `recurrent_gated_delta_step`: one decoding step; `recurrent_gated_delta_rule` loops it over T.
The layer `GatedDeltaNet` is parameter-for-parameter and function-for-function Qwen3-Next's
`Qwen3NextGatedDeltaNet` (in_proj_qkvz / in_proj_ba grouped per key head, conv1d, A_log, dt_bias, norm,
out_proj); caches are transformers' `LinearAttentionLayer` conv + recurrent states.

What this module does not do: fused kernels (pure PyTorch), variable-length packing (cu_seqlens), or any
attention over tokens (see `model/dsa.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import GatedRMSNorm
from .sequence_parallel import SequenceShard, current as current_shard, halo, heads_to_sequence, sequence_to_heads


# ----------------------------------------------------------------------------- pure math
def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor | None, time_dim: bool) -> None:
    lead = 3 if time_dim else 2
    if q.dim() != lead + 1 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, dk] (or [B, H, dk] for a step); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[:lead] != q.shape[:lead]:
        raise ValueError(f"v must share q's leading dims {tuple(q.shape[:lead])}; got v {tuple(v.shape)}")
    if g.shape != q.shape[:lead] or beta.shape != q.shape[:lead]:
        raise ValueError(f"g and beta must be {tuple(q.shape[:lead])}; got g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if state is not None:
        b, h = q.shape[0], q.shape[lead - 1]
        want = (b, h, q.shape[-1], v.shape[-1])
        if tuple(state.shape) != want:
            raise ValueError(f"state must be [B, H, dk, dv] = {want}; got {tuple(state.shape)}")


def recurrent_gated_delta_step(
    q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor, beta_BH: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule. Returns (o_BHV, new state_BHKV); computes in float32."""
    _check_shapes(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_BHKV, time_dim=False)
    q, k, v = q_BHK.float(), k_BHK.float(), v_BHV.float()
    if state_BHKV is None:
        state_BHKV = q.new_zeros(*q.shape, v.shape[-1])
    s = state_BHKV.float() * g_BH.float().exp()[..., None, None]  # decay first: exp(g) S_{t-1}
    pred_BHV = torch.einsum("bhkv,bhk->bhv", s, k)  # what the decayed state already says for key k_t
    delta_BHV = beta_BH.float()[..., None] * (v - pred_BHV)  # delta-rule correction
    s = s + k[..., :, None] * delta_BHV[..., None, :]
    o_BHV = torch.einsum("bhkv,bhk->bhv", s, q)
    return o_BHV.to(v_BHV.dtype), s


def recurrent_gated_delta_rule(
    q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor,
    initial_state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step function looped over time: O(T) sequential steps, for decoding and as a cross-check."""
    _check_shapes(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state_BHKV, time_dim=True)
    state = initial_state_BHKV
    outs = []
    for t in range(q_BTHK.shape[1]):
        o, state = recurrent_gated_delta_step(q_BTHK[:, t], k_BTHK[:, t], v_BTHV[:, t], g_BTH[:, t], beta_BTH[:, t], state)
        outs.append(o)
    if state is None:  # T == 0
        b, _, h, dk = q_BTHK.shape
        state = q_BTHK.new_zeros(b, h, dk, v_BTHV.shape[-1], dtype=torch.float32)
    return torch.stack(outs, 1) if outs else v_BTHV.new_zeros(v_BTHV.shape), state


def chunk_gated_delta_rule(
    q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor,
    initial_state_BHKV: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel gated delta rule. Returns (o_BTHV in v's dtype, final state_BHKV in float32).

    Within a chunk of C steps starting from state S0 (stored [dk, dv]), with c_i = sum_{j<=i} g_j and
    Gamma[i, j] = exp(c_i - c_j), unrolling the recurrence gives the per-step corrections
        Delta = (I + A)^-1 (beta*V - (beta*exp(c)*K) S0),  A[i, j] = beta_i Gamma[i, j] (k_i . k_j) for j < i,
    the outputs  O = exp(c) * (Q S0) + (tril(Q K^T) * Gamma) Delta,
    and the next state  S_C = exp(c_C) S0 + (K * exp(c_C - c))^T Delta.
    The triangular solve and the intra-chunk products run for all chunks at once; only the state hand-off
    is sequential over the T / C chunks.
    """
    _check_shapes(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state_BHKV, time_dim=True)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = v_BTHV.dtype
    B, T, H, DK = q_BTHK.shape
    DV = v_BTHV.shape[-1]
    C = chunk_size
    pad = (-T) % C
    # [B, H, T, *] in float32; padded steps have k = 0, beta = 0, g = 0: they leave the state untouched.
    q, k, v = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)) for x in (q_BTHK, k_BTHK, v_BTHV))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)) for x in (g_BTH, beta_BTH))
    N = (T + pad) // C
    q_BHNCK, k_BHNCK = q.view(B, H, N, C, DK), k.view(B, H, N, C, DK)
    v_BHNCV = v.view(B, H, N, C, DV)
    g_BHNC, beta_BHNC = g.view(B, H, N, C), beta.view(B, H, N, C)

    c_BHNC = g_BHNC.cumsum(-1)  # log of the decay accumulated since the chunk start
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Gamma[i, j] = exp(c_i - c_j) for j <= i; the upper part is set to -inf before exp to avoid overflow.
    logdiff = (c_BHNC[..., :, None] - c_BHNC[..., None, :]).masked_fill(~causal_CC, float("-inf"))
    gamma_BHNCC = logdiff.exp()

    kk_BHNCC = k_BHNCK @ k_BHNCK.transpose(-1, -2)
    a_BHNCC = (beta_BHNC[..., :, None] * gamma_BHNCC * kk_BHNCC).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    lhs = a_BHNCC + eye  # unit lower triangular
    rhs = torch.cat([beta_BHNC[..., None] * v_BHNCV,  # -> U = (I + A)^-1 beta V
                     (beta_BHNC * c_BHNC.exp())[..., None] * k_BHNCK], dim=-1)  # -> W = (I + A)^-1 beta e^c K
    sol = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    u_BHNCV, w_BHNCK = sol[..., :DV], sol[..., DV:]

    qk_BHNCC = (q_BHNCK @ k_BHNCK.transpose(-1, -2)) * gamma_BHNCC  # gamma is already 0 above the diagonal
    q_dec_BHNCK = q_BHNCK * c_BHNC.exp()[..., None]
    c_last_BHN = c_BHNC[..., -1]
    k_dec_BHNCK = k_BHNCK * (c_last_BHN[..., None] - c_BHNC).exp()[..., None]

    state = (q.new_zeros(B, H, DK, DV) if initial_state_BHKV is None else initial_state_BHKV.float())
    outs = []
    for n in range(N):
        delta_BHCV = u_BHNCV[:, :, n] - w_BHNCK[:, :, n] @ state
        outs.append(q_dec_BHNCK[:, :, n] @ state + qk_BHNCC[:, :, n] @ delta_BHCV)
        state = state * c_last_BHN[:, :, n].exp()[..., None, None] + k_dec_BHNCK[:, :, n].transpose(-1, -2) @ delta_BHCV
    o_BHTV = torch.cat(outs, dim=2)[:, :, :T] if outs else q.new_zeros(B, H, 0, DV)
    return o_BHTV.transpose(1, 2).to(out_dtype), state


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) along the last dim (FLA's / Qwen3-Next's form, eps inside the sqrt)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- the layer
class GatedDeltaNet(nn.Module):
    """Gated delta-rule token mixer, equal in parameters and function to Qwen3-Next's `Qwen3NextGatedDeltaNet`.

    x -> in_proj_qkvz -> (q, k, v, z); x -> in_proj_ba -> (b, a);
    (q, k, v) -> causal depthwise conv1d (width `linear_conv_kernel_dim`) -> SiLU;
    q, k L2-normalised, q scaled by dk^-1/2; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias);
    o = gated delta rule; y = out_proj(GatedRMSNorm(o) * SiLU(z)).
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.v_per_k = self.num_v_heads // self.num_k_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.chunk_size = 64
        # Layouts are Qwen3-Next's so checkpoints map 1:1: in_proj_qkvz rows are grouped per key head as
        # [q (dk) | k (dk) | v (v_per_k*dv) | z (v_per_k*dv)], in_proj_ba rows per key head as [b (v_per_k) | a (v_per_k)].
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.num_v_heads, bias=False)
        # conv channels ordered [q heads | k heads | v heads]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size,
                                groups=self.conv_dim, bias=False, padding=self.conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def _split(self, qkvz_BTX: torch.Tensor, ba_BTX: torch.Tensor):
        B, T, _ = qkvz_BTX.shape
        nk, dk, dv, r = self.num_k_heads, self.head_k_dim, self.head_v_dim, self.v_per_k
        q, k, v, z = qkvz_BTX.view(B, T, nk, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba_BTX.view(B, T, nk, 2 * r).split([r, r], dim=-1)
        return (q.reshape(B, T, self.key_dim), k.reshape(B, T, self.key_dim), v.reshape(B, T, self.value_dim),
                z.reshape(B, T, self.num_v_heads, dv), b.reshape(B, T, self.num_v_heads), a.reshape(B, T, self.num_v_heads))

    def _conv(self, x_BCT: torch.Tensor, n_out: int) -> torch.Tensor:
        # x may carry cached left context. The module pads K-1 zeros on both sides, so its first L outputs are the
        # causal ones; keep the last n_out of those. (Calling the module, not its weight, keeps ZeRO-3 gathering it.)
        L = x_BCT.shape[-1]
        y = self.conv1d(x_BCT.to(self.conv1d.weight.dtype))[..., :L]
        return F.silu(y[..., L - n_out:])

    def forward(self, hidden_BTD: torch.Tensor, cache=None, padding_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        if padding_mask_BT is not None:
            # Zero padded positions (Qwen3-Next does the same): zero input -> zero q/k/v -> no state write.
            hidden_BTD = hidden_BTD * padding_mask_BT[..., None].to(hidden_BTD.dtype)
        B, T, _ = hidden_BTD.shape
        q, k, v, z_BTHV, b_BTH, a_BTH = self._split(self.in_proj_qkvz(hidden_BTD), self.in_proj_ba(hidden_BTD))
        mixed_BCT = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        has_state = cache is not None and cache.has_previous_state(self.layer_idx)
        if cache is not None:
            # Returns [cached context | new inputs] (or the inputs padded to the kernel width at prefill) and
            # stores the last kernel-width inputs for the next call.
            mixed_BCT = cache.update_conv_state(mixed_BCT, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        shard = current_shard() if cache is None else None
        if shard is not None:  # a sequence split over ranks: the conv's left context is the previous rank's last inputs
            mixed_BCT = torch.cat([halo(mixed_BCT, self.conv_kernel_size - 1, shard), mixed_BCT], dim=-1)
        mixed_BTC = self._conv(mixed_BCT, T).transpose(1, 2)
        q, k, v = mixed_BTC.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q_BTHK = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k_BTHK = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v_BTHV = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        if self.v_per_k > 1:  # grouped value heads share their key head (GVA), as in Qwen3-Next
            q_BTHK = q_BTHK.repeat_interleave(self.v_per_k, dim=2)
            k_BTHK = k_BTHK.repeat_interleave(self.v_per_k, dim=2)
        q_BTHK = l2norm(q_BTHK.float()) * self.head_k_dim ** -0.5
        k_BTHK = l2norm(k_BTHK.float())
        beta_BTH = b_BTH.float().sigmoid()
        g_BTH = -self.A_log.float().exp() * F.softplus(a_BTH.float() + self.dt_bias.float())

        state0 = cache.layers[self.layer_idx].recurrent_states[0] if has_state else None
        if shard is not None:
            o_BTHV = self._rule_over_ranks(q_BTHK, k_BTHK, v_BTHV.float(), g_BTH, beta_BTH, shard)
        elif has_state and T == 1:
            o, state = recurrent_gated_delta_step(q_BTHK[:, 0], k_BTHK[:, 0], v_BTHV[:, 0].float(), g_BTH[:, 0],
                                                  beta_BTH[:, 0], state0)
            o_BTHV = o[:, None]
        else:
            # short inputs: one chunk of exactly T steps (no padding work); the result does not depend on the chunk size
            chunk = max(1, min(self.chunk_size, T))
            o_BTHV, state = chunk_gated_delta_rule(q_BTHK, k_BTHK, v_BTHV.float(), g_BTH, beta_BTH, state0, chunk)
        if cache is not None:
            cache.update_recurrent_state(state.detach(), self.layer_idx)
        o_BTHV = self.norm(o_BTHV.to(hidden_BTD.dtype), z_BTHV)
        return self.out_proj(o_BTHV.reshape(B, T, self.value_dim))

    def _rule_over_ranks(self, q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, shard: SequenceShard) -> torch.Tensor:
        """The chunked rule over a sequence split across ranks, split by heads instead (model/sequence_parallel.py):
        one all-to-all gives this rank every position of H / N heads, the rule runs over the whole sequence, and a
        second brings the outputs [B, L, H, dv] back to this rank's positions."""
        dk, dv = self.head_k_dim, self.head_v_dim
        packed = torch.cat([q_BLHK, k_BLHK, v_BLHV, g_BLH[..., None], beta_BLH[..., None]], dim=-1)
        q, k, v, g, beta = heads_to_sequence(packed, shard).split([dk, dk, dv, 1, 1], dim=-1)
        T = q.shape[1]
        o_BThV, _ = chunk_gated_delta_rule(q, k, v, g[..., 0], beta[..., 0], None, max(1, min(self.chunk_size, T)))
        return sequence_to_heads(o_BThV, shard)
