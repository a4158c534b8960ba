"""Gated delta rule: chunked vs recurrent vs a slow per-step reference written from the formula, and vs
transformers' Qwen3-Next functions; the layer vs transformers' `Qwen3NextGatedDeltaNet` on copied weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.delta import (GatedDeltaNet, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule,
                         recurrent_gated_delta_step)

B, H, DK, DV = 2, 3, 8, 16


def slow_reference(q, k, v, g, beta, S0_BHKV=None):
    """Per-step, per-head, float64, in the paper's orientation S: [dv, dk]:
    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T ; o_t = S_t q_t."""
    Bn, T, Hn, dk = q.shape
    dv = v.shape[-1]
    out = torch.zeros(Bn, T, Hn, dv, dtype=torch.float64)
    final = torch.zeros(Bn, Hn, dk, dv, dtype=torch.float64)
    for b in range(Bn):
        for h in range(Hn):
            S = torch.zeros(dv, dk, dtype=torch.float64) if S0_BHKV is None else S0_BHKV[b, h].double().T.clone()
            for t in range(T):
                kt, vt, qt = k[b, t, h].double(), v[b, t, h].double(), q[b, t, h].double()
                bt, gt = beta[b, t, h].double(), g[b, t, h].double()
                S = torch.exp(gt) * S @ (torch.eye(dk, dtype=torch.float64) - bt * torch.outer(kt, kt)) + bt * torch.outer(vt, kt)
                out[b, t, h] = S @ qt
            final[b, h] = S.T
    return out, final


def make_inputs(T, seed=0, with_state=False):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, DK, generator=gen))
    k = l2norm(torch.randn(B, T, H, DK, generator=gen))
    v = torch.randn(B, T, H, DV, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.5  # log decay <= 0
    s0 = torch.randn(B, H, DK, DV, generator=gen) if with_state else None
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 3, 13, 65])
def test_chunked_and_recurrent_match_slow_reference(T, with_state):
    q, k, v, g, beta, s0 = make_inputs(T, seed=T, with_state=with_state)
    ref_o, ref_s = slow_reference(q, k, v, g, beta, s0)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    torch.testing.assert_close(o_r.double(), ref_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_r.double(), ref_s, atol=1e-5, rtol=1e-4)
    for C in (4, 16, 64):
        o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=C)
        torch.testing.assert_close(o_c.double(), ref_o, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s_c.double(), ref_s, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=1e-4)


def test_chunked_state_handoff_equals_one_pass():
    """Splitting a sequence and carrying the state gives the same outputs (prefill + continuation)."""
    q, k, v, g, beta, _ = make_inputs(40, seed=7)
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, None, chunk_size=16)
    o1, s1 = chunk_gated_delta_rule(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], None, chunk_size=16)
    o2, s2 = chunk_gated_delta_rule(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], beta[:, 23:], s1, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s2, s_full, atol=1e-5, rtol=1e-4)


def test_step_decay_only_when_beta_zero():
    """beta = 0 means no write: the state just decays by exp(g) and o = state^T q."""
    q, k, v, g, beta, s0 = make_inputs(1, seed=3, with_state=True)
    o, s = recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], torch.zeros_like(beta[:, 0]), s0)
    want = s0 * g[:, 0].exp()[..., None, None]
    torch.testing.assert_close(s, want)
    torch.testing.assert_close(o, torch.einsum("bhkv,bhk->bhv", want, q[:, 0]))


@pytest.mark.parametrize("T", [3, 12, 13])
def test_against_transformers_qwen3_next_functions(T):
    """Convention map: transformers' functions take raw q/k and (with use_qk_l2norm_in_kernel=True) L2-normalise
    both (eps 1e-6) and scale q by dk^-1/2 inside; ours take q, k already normalised and scaled. State layout
    [B, H, dk, dv] is the same."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                     torch_recurrent_gated_delta_rule)
    gen = torch.Generator().manual_seed(T)
    q, k = torch.randn(B, T, H, DK, generator=gen), torch.randn(B, T, H, DK, generator=gen)
    v = torch.randn(B, T, H, DV, generator=gen)
    beta, g = torch.rand(B, T, H, generator=gen), -torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, DK, DV, generator=gen)
    ref_o, ref_s = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    ref_oc, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=4, initial_state=s0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = l2norm(q) * DK ** -0.5, l2norm(k)
    o_c, s_c = chunk_gated_delta_rule(qn, kn, v, g, beta, s0, chunk_size=4)
    o_r, s_r = recurrent_gated_delta_rule(qn, kn, v, g, beta, s0)
    for o, s in ((o_c, s_c), (o_r, s_r)):
        torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(o_c, ref_oc, atol=1e-5, rtol=1e-4)


def test_chunked_gradients_match_recurrent():
    q, k, v, g, beta, s0 = make_inputs(13, seed=11, with_state=True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, s0)]
    o1, s1 = chunk_gated_delta_rule(*leaves[:5], leaves[5], chunk_size=4)
    (o1.square().sum() + s1.sum()).backward()
    g_chunk = [x.grad.clone() for x in leaves]
    leaves2 = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, s0)]
    o2, s2 = recurrent_gated_delta_rule(*leaves2[:5], leaves2[5])
    (o2.square().sum() + s2.sum()).backward()
    for a, b in zip(g_chunk, [x.grad for x in leaves2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bad_shapes_raise_clear_errors():
    q, k, v, g, beta, _ = make_inputs(5)
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_rule(q, k, v, g, beta[:, :3])
    with pytest.raises(ValueError, match="state"):
        chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros(B, H, DV, DK))


def _qwen3_next_config(**kw):
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                           linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=1,
                           layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           num_experts=4, num_experts_per_tok=2, **kw)


def test_layer_equals_transformers_qwen3_next_gated_delta_net():
    """Same parameter names and shapes; same outputs on the same weights (load_state_dict strict)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    from model.configuration import HybridMoeConfig
    torch.manual_seed(0)
    qcfg = _qwen3_next_config()
    theirs = Qwen3NextGatedDeltaNet(qcfg, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours_cfg = HybridMoeConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=1,
                               layer_types=["linear_attention"])
    ours = GatedDeltaNet(ours_cfg, 0).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 21, 48)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-4)
