"""Gated DSA: indexer formula, top-k causality, dense equivalence (vs transformers' Qwen3NextAttention), sparse
reads, gradient isolation between the indexer and the main attention, indexer loss formula."""
from __future__ import annotations

import math

import pytest
import torch

from model.configuration import HybridMoeConfig
from model.dsa import (GatedIndexedAttention, RotaryEmbedding, indexer_kl_loss, lightning_indexer_scores,
                       topk_selection, visible_mask)


def cfg(**kw):
    base = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, index_n_heads=3,
                index_head_dim=8, num_hidden_layers=1, layer_types=["indexed_attention"], index_topk=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    base.update(kw)
    return HybridMoeConfig(**base)


def make_layer(c, seed=0):
    torch.manual_seed(seed)
    layer = GatedIndexedAttention(c, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def rope(c, T, B=2):
    pos = torch.arange(T)[None].expand(B, T)
    return RotaryEmbedding(c.rotary_dim, c.rope_parameters["rope_theta"])(pos, torch.float32)


def test_indexer_scores_equal_formula():
    gen = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(2, 5, 3, 4, generator=gen), torch.randn(2, 7, 4, generator=gen), torch.randn(2, 5, 3, generator=gen)
    got = lightning_indexer_scores(q, k, w)
    want = torch.zeros(2, 5, 7)
    for b in range(2):
        for t in range(5):
            for s in range(7):
                want[b, t, s] = sum(w[b, t, h] * max(0.0, float(q[b, t, h] @ k[b, s])) for h in range(3))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_topk_selection_is_causal_and_picks_best():
    gen = torch.Generator().manual_seed(1)
    T = 9
    scores = torch.randn(1, T, T, generator=gen)
    vis = visible_mask(T, T, None, "cpu")
    sel = topk_selection(scores, vis, 3)
    for t in range(T):
        chosen = sel[0, t].nonzero().flatten().tolist()
        assert all(s <= t for s in chosen)
        want = sorted(range(t + 1), key=lambda s: -float(scores[0, t, s]))[:3]
        assert sorted(chosen) == sorted(want)


def test_dense_when_k_covers_all_tokens_equals_qwen3_next_attention():
    """k >= T: exactly transformers' Qwen3NextAttention (same names; the indexer params are extra)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding
    c = cfg(index_topk=64)
    ours = make_layer(c)
    qc = Qwen3NextConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                         layer_types=["full_attention"], partial_rotary_factor=0.5, rope_theta=10000.0)
    qc._attn_implementation = "eager"
    theirs = Qwen3NextAttention(qc, 0).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and all(k.startswith("indexer.") for k in unexpected)
    T = 17
    x = torch.randn(2, T, 48)
    cos, sin = rope(c, T)
    q_cos, q_sin = Qwen3NextRotaryEmbedding(qc)(x, torch.arange(T)[None].expand(2, T))
    torch.testing.assert_close(cos, q_cos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    want, _ = theirs(x, (q_cos, q_sin), mask)
    got, _ = ours(x, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_sparse_reads_only_selected_tokens():
    """k < T: changing values/keys of a token outside a query's top-k set leaves that query's output unchanged,
    and the selected set is what the indexer formula says."""
    c = cfg(index_topk=4)
    layer = make_layer(c, seed=3)
    T = 12
    x = torch.randn(1, T, 48)
    cos, sin = rope(c, T, B=1)
    out, _ = layer(x, cos, sin)
    qI, kI, wI = layer.indexer.project(x, cos, sin)
    sel = topk_selection(lightning_indexer_scores(qI, kI, wI), visible_mask(T, T, None, "cpu"), 4)
    assert int(sel[0, -1].sum()) == 4
    t = T - 1
    outside = [s for s in range(T) if not sel[0, t, s]]
    inside = [s for s in range(T) if sel[0, t, s]]
    # Perturb the main attention's V only (indexer inputs unchanged) through v_proj on a copy
    with torch.no_grad():
        v_full = layer.v_proj(x)
    def run_with_v(v_new):
        orig = layer.v_proj.forward
        layer.v_proj.forward = lambda inp: v_new
        try:
            return layer(x, cos, sin)[0]
        finally:
            layer.v_proj.forward = orig
    v2 = v_full.clone()
    v2[0, outside] += 10.0
    torch.testing.assert_close(run_with_v(v2)[0, t], out[0, t], atol=1e-6, rtol=1e-6)
    v3 = v_full.clone()
    v3[0, inside[0]] += 10.0
    assert (run_with_v(v3)[0, t] - out[0, t]).abs().max() > 1e-3


def test_gather_path_equals_masked_path():
    c = cfg(index_topk=5)
    layer = make_layer(c, seed=4)
    T = 23
    x = torch.randn(2, T, 48)
    cos, sin = rope(c, T)
    a, _ = layer(x, cos, sin, force_gather=False)
    b, _ = layer(x, cos, sin, force_gather=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gradient_isolation(mode):
    """LM-side loss reaches no indexer parameter; the indexer loss reaches only indexer parameters."""
    c = cfg(index_topk=4, indexer_loss_mode=mode)
    layer = make_layer(c, seed=5).train()
    T = 10
    x = torch.randn(2, T, 48, requires_grad=True)
    cos, sin = rope(c, T)
    out, idx_loss = layer(x, cos, sin, compute_indexer_loss=True)
    out.square().sum().backward(retain_graph=True)
    for n, p in layer.named_parameters():
        if n.startswith("indexer."):
            assert p.grad is None or p.grad.abs().max() == 0, n
        else:
            assert p.grad is not None and p.grad.abs().max() > 0, n
    layer.zero_grad(set_to_none=True)
    x.grad = None
    idx_loss.backward()
    assert x.grad is None or x.grad.abs().max() == 0
    for n, p in layer.named_parameters():
        if n.startswith("indexer."):
            assert p.grad is not None and p.grad.abs().max() > 0, n
        else:
            assert p.grad is None or p.grad.abs().max() == 0, n


def test_indexer_loss_equals_formula():
    gen = torch.Generator().manual_seed(6)
    B, H, T, S = 2, 3, 4, 6
    probs = torch.softmax(torch.randn(B, H, T, S, generator=gen), -1)
    scores = torch.randn(B, T, S, generator=gen)
    support = torch.rand(B, T, S, generator=gen) > 0.3
    support[..., 0] = True
    got = indexer_kl_loss(probs, scores, support)
    total, n = 0.0, 0
    for b in range(B):
        for t in range(T):
            idx = [s for s in range(S) if support[b, t, s]]
            p = torch.tensor([float(probs[b, :, t, s].sum()) for s in idx], dtype=torch.float64)
            p = p / p.sum()
            logits = torch.tensor([float(scores[b, t, s]) for s in idx], dtype=torch.float64)
            logq = logits - torch.logsumexp(logits, 0)
            total += float((p * (p.log() - logq)).sum())
            n += 1
    assert math.isclose(float(got), total / n, rel_tol=1e-5, abs_tol=1e-6)


def test_dense_mode_loss_uses_dense_target():
    """In warm-up mode the KL target covers every visible key even when attention is sparse."""
    c = cfg(index_topk=3, indexer_loss_mode="dense")
    layer = make_layer(c, seed=7).train()
    T = 8
    x = torch.randn(1, T, 48)
    cos, sin = rope(c, T, B=1)
    _, loss = layer(x, cos, sin, compute_indexer_loss=True)
    # reference: dense probabilities from a dense copy of the layer
    dense = make_layer(cfg(index_topk=64, indexer_loss_mode="dense"), seed=7)
    dense.load_state_dict(layer.state_dict())
    qI, kI, wI = layer.indexer.project(x, cos, sin)
    scores = lightning_indexer_scores(qI, kI, wI)
    q, _ = layer.q_proj(x).view(1, T, 4, 32).chunk(2, -1)
    from model.dsa import apply_rope
    qh = apply_rope(layer.q_norm(q).transpose(1, 2), cos, sin, 1)
    kh = apply_rope(layer.k_norm(layer.k_proj(x).view(1, T, 2, 16)).transpose(1, 2), cos, sin, 1).repeat_interleave(2, 1)
    logits = (qh @ kh.transpose(-1, -2)) / 4.0
    vis = visible_mask(T, T, None, "cpu")
    probs = torch.softmax(logits.masked_fill(~vis[:, None], float("-inf")), -1)
    want = indexer_kl_loss(probs, scores, vis.expand(1, T, T))
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("topk,mode,loss", [(5, "sparse", True), (5, "dense", True), (5, "sparse", False), (2048, "dense", False)])
def test_query_blocks_equal_one_shot(topk, mode, loss):
    """Long inputs attend in blocks of queries (`query_block`): the same output, indexer loss and gradients
    (main weights and indexer) as all queries at once, with padding, sparse and dense, both loss modes."""
    c = cfg(index_topk=topk, indexer_loss_mode=mode)
    T = 37
    cos, sin = rope(c, T)
    x = torch.randn(2, T, 48, generator=torch.Generator().manual_seed(7))
    pad = torch.ones(2, T, dtype=torch.bool)
    pad[1, 30:] = False

    def run(block):
        layer = make_layer(c).train()
        layer.query_block = block
        xx = x.clone().requires_grad_(True)
        out, idx_loss = layer(xx, cos, sin, key_padding_BS=pad, compute_indexer_loss=loss)
        total = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + (idx_loss if idx_loss is not None else 0.0)
        total.backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        return out.detach(), idx_loss, xx.grad, grads

    (o1, l1, gx1, g1), (o2, l2, gx2, g2) = run(4096), run(8)
    torch.testing.assert_close(o2, o1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx2, gx1, atol=1e-5, rtol=1e-5)
    assert g1.keys() == g2.keys() and (not loss or any(n.startswith("indexer.") for n in g1))
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], atol=1e-5, rtol=1e-4, msg=n)
    assert (l1 is None) == (l2 is None) == (not loss)
    if loss:
        torch.testing.assert_close(l2, l1, atol=1e-6, rtol=1e-5)


def test_query_blocks_after_past_keys_equal_one_shot():
    """Blocks whose queries follow S - T earlier keys (a prefill after a cache, or a sequence shard after the
    shards before it) read each block's causal keys only: the same output, indexer loss and input gradient."""
    class Past:  # keys of P earlier positions, as a cache returns them ahead of the new ones
        def __init__(self, k, v, kI):
            self.k, self.v, self.kI = k, v, kI

        def update(self, k, v, layer_idx):
            return torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)

        def update_indexer(self, kI, layer_idx):
            return torch.cat([self.kI, kI], 1)

    for topk in (5, 2048):
        c = cfg(index_topk=topk, indexer_loss_mode="sparse")
        P, T = 6, 29
        cos, sin = rope(c, P + T)
        cos, sin = cos[:, P:], sin[:, P:]
        g = torch.Generator().manual_seed(3)
        x = torch.randn(2, T, 48, generator=g)
        ref = make_layer(c)
        pk = torch.randn(2, ref.num_kv_heads, P, ref.head_dim, generator=g)
        pv = torch.randn(2, ref.num_kv_heads, P, ref.head_dim, generator=g)
        pI = torch.randn(2, P, ref.indexer.project(x, cos, sin)[1].shape[-1], generator=g)
        runs = []
        for block in (4096, 8):
            layer = make_layer(c).train()
            layer.query_block = block
            xx = x.clone().requires_grad_(True)
            out, loss = layer(xx, cos, sin, cache=Past(pk, pv, pI), compute_indexer_loss=True)
            (out.sum() + loss).backward()
            runs.append((out.detach(), loss.detach(), xx.grad))
        for a, b in zip(*runs):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
