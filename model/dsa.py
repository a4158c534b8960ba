"""Gated DSA ("Gated Dynamic Sparse Attention"): Qwen3-Next gated attention whose keys are chosen per query by a
lightning indexer (DeepSeek-V3.2's DeepSeek Sparse Attention, arXiv:2512.02556 / the V3.2-Exp report).

Math (per batch row; t = query, s = key, h = indexer head):
    I[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s])              lightning indexer, one key per token
    w[t, h] = weights_proj(x_t)[h] * H_I^-1/2 * D_I^-1/2             (DeepSeek's two scale factors, folded in)
    Sel(t)  = top-k_s { I[t, s] : s visible from t }                  causal (+ padding) top-k, k = index_topk
    o_t     = o_proj( sigmoid(gate_t) * Attn(q_t, K[Sel(t)], V[Sel(t)]) )
When k >= the number of visible keys, Sel(t) is every visible key and the layer is exactly dense causal gated
attention — the code takes that branch without scoring, so the equality is exact, and vLLM can serve such
configs with its dense (gated) attention kernel.

The attention part (q_proj -> query + per-head gate, k_proj, v_proj, zero-centred q_norm / k_norm, partial
half-split RoPE, GQA, o_proj) is transformers' `Qwen3NextAttention`, parameter for parameter. The indexer adds
`indexer.wq`, `indexer.wk`, `indexer.k_norm` (LayerNorm), `indexer.weights_proj`. Unlike DeepSeek-V3.2 (whose
indexer query comes from the MLA query latent) ours reads the layer input; RoPE is applied to its first
`rotary_dim` dims with the attention's cos/sin.

Indexer training (DeepSeek-V3.2): the indexer reads a *detached* layer input, so its loss never reaches the
main model, and the main model's LM loss never reaches the indexer (top-k is discrete). The loss is
KL(p || softmax(I)) per query, p = head-summed main attention, L1-normalised:
  - mode "dense" (warm-up): p and softmax(I) over all visible keys, p from the dense attention distribution;
  - mode "sparse": both over the selected set Sel(t), p from the sparse attention actually used.
`p` is detached (a target). The loss is averaged over non-padded query tokens.

What this module does not do: fused sparse kernels, FP8 indexer scoring, or Hadamard rotation (DeepSeek's
efficiency tricks); decoding gathers the k selected keys, which is what makes a decoded token's attention cost
O(k) instead of O(context) (the indexer itself stays O(context), with one small key per token).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .norms import ZeroCenteredRMSNorm
from .sequence_parallel import ShardKeys, current as current_shard


# ----------------------------------------------------------------------------- RoPE (Qwen3-Next conventions)
class RotaryEmbedding(nn.Module):
    """Default RoPE over the first `rotary_dim` dims (partial rotary), half-split layout (`rotate_half`)."""

    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim, self.base = rotary_dim, base
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        # also called from `_init_weights`: from_pretrained builds modules on the meta device, so non-persistent
        # buffers must be recomputed there
        return 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    @torch.no_grad()
    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BTR = position_ids_BT[..., None].float() * self.inv_freq.to(position_ids_BT.device)
        emb = torch.cat([freqs_BTR, freqs_BTR], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, head_dim_axis: int) -> torch.Tensor:
    """Rotate the first R dims of x; `head_dim_axis` = 1 for [B, H, T, D], 2 for [B, T, H, D], None for [B, T, D]."""
    cos, sin = (c if head_dim_axis is None else c.unsqueeze(head_dim_axis) for c in (cos_BTR, sin_BTR))
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


# ----------------------------------------------------------------------------- pure functions
def lightning_indexer_scores(q_BTHD: torch.Tensor, k_BSD: torch.Tensor, w_BTH: torch.Tensor) -> torch.Tensor:
    """I[b, t, s] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, s]). Returns [B, T, S] in float32."""
    if q_BTHD.dim() != 4 or k_BSD.dim() != 3 or w_BTH.shape != q_BTHD.shape[:3] or k_BSD.shape[-1] != q_BTHD.shape[-1]:
        raise ValueError(f"indexer expects q [B,T,H,D], k [B,S,D], w [B,T,H]; got {tuple(q_BTHD.shape)}, "
                         f"{tuple(k_BSD.shape)}, {tuple(w_BTH.shape)}")
    B, T, H, D = q_BTHD.shape
    logits = torch.bmm(q_BTHD.float().reshape(B, T * H, D), k_BSD.float().transpose(1, 2))  # [B, T*H, S]
    relu_BTHS = F.relu(logits).view(B, T, H, -1)
    return torch.matmul(w_BTH.float().unsqueeze(2), relu_BTHS).squeeze(2)  # sum_h w[t,h] * relu[t,h,s]


def visible_mask(T: int, S: int, key_padding_BS: torch.Tensor | None, device, rows: tuple[int, int] | None = None
                 ) -> torch.Tensor:
    """[B or 1, T, S] bool: key s is visible from query t (the T queries are the last T of the S positions).
    `rows` = (t0, t1): only queries t0 <= t < t1, [B or 1, t1 - t0, S]."""
    t0, t1 = rows if rows is not None else (0, T)
    t_idx = torch.arange(t0, t1, device=device)[:, None] + (S - T)
    vis_TS = torch.arange(S, device=device)[None, :] <= t_idx
    if key_padding_BS is None:
        return vis_TS[None]
    return vis_TS[None] & key_padding_BS.bool()[:, None, :]


def topk_selection(scores_BTS: torch.Tensor, visible_BTS: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [B, T, S]: for each query the k visible keys with the highest score (all visible ones if fewer).

    Ties at the k-th score go to the most recent keys. The rule must be deterministic: ReLU makes exact-zero
    scores common, and a prefill (all queries at once) and a decode step (one query) must pick the same set.
    """
    if k < 1:
        raise ValueError(f"top-k must be >= 1, got {k}")
    S = scores_BTS.shape[-1]
    visible_BTS = visible_BTS.expand_as(scores_BTS)
    if k >= S:
        return visible_BTS.clone()
    masked = scores_BTS.masked_fill(~visible_BTS, float("-inf"))
    kth_BT1 = masked.topk(k, dim=-1).values[..., -1:]
    above = (masked > kth_BT1) & visible_BTS
    tie = (masked == kth_BT1) & visible_BTS
    quota_BT1 = k - above.sum(-1, keepdim=True)
    ties_from_end = tie.flip(-1).cumsum(-1).flip(-1)  # number of tied keys at positions >= s
    return above | (tie & (ties_from_end <= quota_BT1))


def indexer_kl_loss(attn_probs_BHTS: torch.Tensor, index_scores_BTS: torch.Tensor, support_BTS: torch.Tensor,
                    query_valid_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over valid queries of KL(p || softmax(I)) on `support`, with p = L1-normalised head-sum of the main
    attention (detached). DeepSeek-V3.2 indexer loss."""
    p_BTS = attn_probs_BHTS.detach().float().sum(1).masked_fill(~support_BTS, 0.0)
    p_BTS = p_BTS / p_BTS.sum(-1, keepdim=True).clamp_min(1e-20)
    logq_BTS = torch.log_softmax(index_scores_BTS.float().masked_fill(~support_BTS, float("-inf")), dim=-1)
    # p * (log p - log q) with 0 * log 0 = 0 and nothing outside the support
    kl_terms = torch.where(p_BTS > 0, p_BTS * (p_BTS.clamp_min(1e-30).log() - logq_BTS), torch.zeros_like(p_BTS))
    kl_BT = kl_terms.sum(-1)
    valid = support_BTS.any(-1)
    if query_valid_BT is not None:
        valid = valid & query_valid_BT.bool()
    return (kl_BT * valid).sum() / valid.sum().clamp_min(1)


def _share(loss: torch.Tensor | None, shard_keys: ShardKeys | None, B: int) -> torch.Tensor | None:
    """A sharded forward's mean indexer loss over this rank's queries, weighted by their share of the sequence's
    queries: the ranks' losses then add up to the unsplit forward's mean."""
    return loss if loss is None or shard_keys is None else loss * shard_keys.query_share(B)


# Queries per block when a layer attends more than this many at once (training, prefill): the indexer's scores,
# the selection and the attention weights exist for one block at a time ([B, block, S] and [B, H, block, S], not
# [B, T, S] and [B, H, T, S]: at T = S = 32k and 2 heads that is 0.27 GB a block instead of 8.6 GB), and under
# autograd each block is checkpointed, so its backward recomputes them one block at a time as well.
QUERY_BLOCK = 1024


# ----------------------------------------------------------------------------- the layer
class LightningIndexer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.scale = self.n_heads ** -0.5 * self.head_dim ** -0.5

    def project(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_I [B,T,H_I,D_I], k_I [B,T,D_I], w [B,T,H_I]) from the (already detached) layer input."""
        B, T, _ = x_BTD.shape
        q = apply_rope(self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim), cos, sin, head_dim_axis=2)
        k = apply_rope(self.k_norm(self.wk(x_BTD)), cos, sin, head_dim_axis=None)
        return q, k, self.weights_proj(x_BTD) * self.scale


class GatedIndexedAttention(nn.Module):
    """Gated DSA token mixer. Returns (output [B,T,D], indexer loss scalar or None)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim ** -0.5
        self.index_topk = config.index_topk
        self.indexer_loss_mode = config.indexer_loss_mode
        self.attention_dropout = config.attention_dropout
        D, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim * 2, bias=bias)  # per head: [query | gate]
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.indexer = LightningIndexer(config)
        self.query_block = QUERY_BLOCK

    def forward(self, hidden_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                key_padding_BS: torch.Tensor | None = None, compute_indexer_loss: bool = False,
                force_gather: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = hidden_BTD.shape
        shard_keys = None
        if cache is None and current_shard() is not None:  # a sequence split over ranks (model/sequence_parallel.py)
            cache = shard_keys = ShardKeys(current_shard())
            key_padding_BS = shard_keys.key_padding(B, hidden_BTD.device)
        H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(hidden_BTD).view(B, T, H, 2 * Dh).chunk(2, dim=-1)
        gate_BTX = gate.reshape(B, T, H * Dh)
        q_BHTD = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin, head_dim_axis=1)
        k_BHTD = apply_rope(self.k_norm(self.k_proj(hidden_BTD).view(B, T, Hkv, Dh)).transpose(1, 2), cos, sin, head_dim_axis=1)
        v_BHTD = self.v_proj(hidden_BTD).view(B, T, Hkv, Dh).transpose(1, 2)
        if cache is not None:
            k_BHTD, v_BHTD = cache.update(k_BHTD, v_BHTD, self.layer_idx)
        S = k_BHTD.shape[2]
        if key_padding_BS is not None and key_padding_BS.shape != (B, S):
            raise ValueError(f"attention_mask must cover past + current tokens: want [{B}, {S}], got {tuple(key_padding_BS.shape)}")
        sparse = self.index_topk < S  # otherwise every visible key is selected: dense gated attention, exactly
        gather = (sparse and not compute_indexer_loss and T * 4 <= S) if force_gather is None else (force_gather and sparse)
        if T > self.query_block and not gather:
            out_BHTD, loss = self._attend_blocks(hidden_BTD, q_BHTD, k_BHTD, v_BHTD, cos, sin, cache, key_padding_BS,
                                                 sparse, compute_indexer_loss)
            out_BTX = out_BHTD.transpose(1, 2).reshape(B, T, H * Dh)
            return self.o_proj(out_BTX * torch.sigmoid(gate_BTX)), _share(loss, shard_keys, B)
        visible_BTS = visible_mask(T, S, key_padding_BS, hidden_BTD.device)

        scores_BTS = None
        if sparse or compute_indexer_loss or cache is not None:
            # Detached input: the indexer never trains the main model (DeepSeek-V3.2).
            qI, kI, wI = self.indexer.project(hidden_BTD.detach(), cos, sin)
            if cache is not None:
                kI = cache.update_indexer(kI, self.layer_idx)
            if sparse or compute_indexer_loss:
                scores_BTS = lightning_indexer_scores(qI, kI, wI)

        loss = None
        if gather:
            out_BHTD = self._attend_gathered(q_BHTD, k_BHTD, v_BHTD, scores_BTS, visible_BTS)
        else:
            selected_BTS = topk_selection(scores_BTS, visible_BTS, self.index_topk) if sparse else visible_BTS
            out_BHTD, probs_BHTS = self._attend_masked(q_BHTD, k_BHTD, v_BHTD, selected_BTS)
            if compute_indexer_loss:
                query_valid = None if key_padding_BS is None else key_padding_BS[:, S - T:]
                if self.indexer_loss_mode == "sparse" or not sparse:
                    loss = indexer_kl_loss(probs_BHTS, scores_BTS, selected_BTS.expand(B, T, S), query_valid)
                else:  # dense warm-up target: the dense attention distribution over all visible keys
                    with torch.no_grad():
                        _, dense_probs = self._attend_masked(q_BHTD, k_BHTD, v_BHTD, visible_BTS, need_output=False)
                    loss = indexer_kl_loss(dense_probs, scores_BTS, visible_BTS.expand(B, T, S), query_valid)
        out_BTX = out_BHTD.transpose(1, 2).reshape(B, T, H * Dh)
        return self.o_proj(out_BTX * torch.sigmoid(gate_BTX)), _share(loss, shard_keys, B)

    def _attend_blocks(self, hidden_BTD, q_BHTD, k_BHSD, v_BHSD, cos, sin, cache, key_padding_BS, sparse: bool,
                       compute_indexer_loss: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's attention (and indexer loss) over blocks of `query_block` queries: each query's scores,
        top-k selection and attention read only its own row, so the blocks give the one-shot result (to float
        round-off in the loss's mean). The indexer's keys are computed once for all S positions."""
        B, H, T, Dh = q_BHTD.shape
        S = k_BHSD.shape[2]
        qI = kI = wI = None
        if sparse or compute_indexer_loss or cache is not None:
            qI, kI, wI = self.indexer.project(hidden_BTD.detach(), cos, sin)  # detached, as in `forward`
            if cache is not None:
                kI = cache.update_indexer(kI, self.layer_idx)
        grad = torch.is_grad_enabled()
        outs, loss_sum, n_valid = [], None, 0
        for t0 in range(0, T, self.query_block):
            t1 = min(T, t0 + self.query_block)
            # Causal: the block's queries see keys up to S - T + t1 only; the later keys are masked for every one
            # of them, so they are left out (the scores, selection and attention of the first blocks shrink).
            s1 = S - T + t1
            vis = visible_mask(T, S, key_padding_BS, hidden_BTD.device, rows=(t0, t1))[..., :s1]
            valid = vis.any(-1).expand(B, t1 - t0)
            if key_padding_BS is not None:
                valid = valid & key_padding_BS[:, S - T + t0:S - T + t1].bool()
            args = (q_BHTD[:, :, t0:t1], k_BHSD[:, :, :s1], v_BHSD[:, :, :s1], vis, valid,
                    None if qI is None else qI[:, t0:t1], None if kI is None else kI[:, :s1],
                    None if wI is None else wI[:, t0:t1])
            fn = lambda *a: self._attend_block(*a, sparse=sparse, compute_indexer_loss=compute_indexer_loss)  # noqa: E731
            out, block_loss = checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
            outs.append(out)
            if block_loss is not None:
                n = int(valid.sum())
                loss_sum = block_loss * n if loss_sum is None else loss_sum + block_loss * n
                n_valid += n
        loss = None if loss_sum is None else loss_sum / max(n_valid, 1)
        return torch.cat(outs, dim=2), loss

    def _attend_block(self, q_BHQD, k_BHSD, v_BHSD, visible_BQS, valid_BQ, qI, kI, wI, *, sparse: bool,
                      compute_indexer_loss: bool):
        """One block of queries: (out [B, H, Q, D], the block's mean indexer loss or None), as `forward` computes
        them for all queries at once."""
        B, _, Q, _ = q_BHQD.shape
        S = k_BHSD.shape[2]
        scores = lightning_indexer_scores(qI, kI, wI) if (sparse or compute_indexer_loss) else None
        selected = topk_selection(scores, visible_BQS, self.index_topk) if sparse else visible_BQS
        out, probs = self._attend_masked(q_BHQD, k_BHSD, v_BHSD, selected)
        if not compute_indexer_loss:
            return out, None
        if self.indexer_loss_mode == "sparse" or not sparse:
            return out, indexer_kl_loss(probs, scores, selected.expand(B, Q, S), valid_BQ)
        with torch.no_grad():
            _, dense = self._attend_masked(q_BHQD, k_BHSD, v_BHSD, visible_BQS, need_output=False)
        return out, indexer_kl_loss(dense, scores, visible_BQS.expand(B, Q, S), valid_BQ)

    def _attend_masked(self, q_BHTD, k_BHSD, v_BHSD, allowed_BTS, need_output: bool = True):
        """Eager attention over all S keys with a boolean mask; returns (out [B,H,T,D], probs [B,H,T,S]).
        GQA without copying K / V: the G query heads of a KV head are folded into the row dimension."""
        B, H, T, Dh = q_BHTD.shape
        Hkv, G, S = self.num_kv_heads, self.groups, k_BHSD.shape[2]
        q_BNRD = q_BHTD.reshape(B, Hkv, G * T, Dh)  # rows ordered (g, t)
        logits = ((q_BNRD @ k_BHSD.transpose(-1, -2)) * self.scaling).view(B, Hkv, G, T, S)
        logits = logits.masked_fill(~allowed_BTS[:, None, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        probs = torch.nan_to_num(probs, nan=0.0).to(q_BHTD.dtype)  # a fully padded query row attends to nothing
        if not need_output:
            return None, probs.view(B, H, T, S)
        p = F.dropout(probs, p=self.attention_dropout, training=self.training)
        out = p.view(B, Hkv, G * T, S) @ v_BHSD
        return out.view(B, H, T, Dh), probs.view(B, H, T, S)

    def _attend_gathered(self, q_BHTD, k_BHSD, v_BHSD, scores_BTS, visible_BTS):
        """Sparse attention that reads only the k selected keys per query: cost O(T * k) instead of O(T * S)."""
        B, H, T, Dh = q_BHTD.shape
        Hkv, G, K = self.num_kv_heads, self.groups, self.index_topk
        masked = scores_BTS.masked_fill(~visible_BTS, float("-inf"))
        vals_BTK, idx_BTK = masked.topk(K, dim=-1)
        kth = vals_BTK[..., -1:]
        if bool(((masked == kth).sum(-1) == (vals_BTK == kth).sum(-1)).all()):
            valid_BTK = vals_BTK > float("-inf")  # no tie straddles the k-th place: topk's set is the selection
        else:  # resolve ties exactly as `topk_selection` does (most recent first), so decode matches prefill
            sel_BTS = topk_selection(scores_BTS, visible_BTS, K)
            idx_BTK = sel_BTS.to(torch.int8).topk(K, dim=-1).indices  # the (at most K) selected positions
            valid_BTK = sel_BTS.gather(-1, idx_BTK)
        # Row gather with one index_select over the flattened [B*Hkv*S, D] cache (whole 128-float rows; an
        # element-wise torch.gather with an expanded index is several times slower).
        S = k_BHSD.shape[2]
        base_BN1 = (torch.arange(B * Hkv, device=idx_BTK.device) * S).view(B, Hkv, 1)
        rows = (base_BN1 + idx_BTK.reshape(B, 1, T * K)).reshape(-1)
        k_sel = k_BHSD.reshape(B * Hkv * S, Dh).index_select(0, rows).view(B, Hkv, T, K, Dh)
        v_sel = v_BHSD.reshape(B * Hkv * S, Dh).index_select(0, rows).view(B, Hkv, T, K, Dh)
        # batched matmuls over (B, Hkv, T); the G query heads of a KV head are the rows
        q_BNTGD = q_BHTD.view(B, Hkv, G, T, Dh).transpose(2, 3)
        logits = (q_BNTGD @ k_sel.transpose(-1, -2)) * self.scaling  # [B, Hkv, T, G, K]
        logits = logits.masked_fill(~valid_BTK[:, None, :, None, :], float("-inf"))
        probs = torch.nan_to_num(torch.softmax(logits, dim=-1, dtype=torch.float32), nan=0.0).to(q_BHTD.dtype)
        out = (probs @ v_sel).transpose(2, 3)  # [B, Hkv, G, T, D]
        return out.reshape(B, H, T, Dh)
