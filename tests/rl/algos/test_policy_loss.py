"""Policy losses vs hand-computed cases, loop references, and the identities in the issue's Checks."""
from __future__ import annotations

import math

import pytest
import torch

from tests.rl.algos.algos_refs import (
    positions,
    random_batch,
    ref_aggregate,
    ref_cispo_token,
    ref_dual_clip_token,
    ref_dual_clip_token_grad,
    ref_gspo_tokens,
    ref_ppo_token,
    ref_ppo_token_grad,
    tolist2,
)
from rl.algos.aggregation import aggregate, aggregation_weights
from rl.algos.policy_loss import POLICY_LOSSES, PolicyLossInputs, PolicyLossParams, compute_policy_loss

MODES = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "domain_token_mean"]
LOSSES = ["ppo_clip", "dual_clip", "gspo", "cispo"]
P = PolicyLossParams(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)


def _per_token(name, inputs, params=P):
    return POLICY_LOSSES.get(name)(inputs, params)


# ----------------------------------------------------------------------------- hand-computed
def test_ppo_clip_hand_computed():
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    lp = torch.log(ratios).requires_grad_(True)
    loss_BT, m = _per_token("ppo_clip", PolicyLossInputs(lp, torch.zeros_like(lp), adv, torch.ones(1, 4)))
    # A=+1,r=1.5: -min(1.5, 1.28) = -1.28 (clipped); A=-1,r=.5: -min(-.5, -.8) = .8 (clipped);
    # A=-1,r=1.5: -min(-1.5, -1.28) = 1.5; A=+1,r=.5: -min(.5, .8) = -.5
    torch.testing.assert_close(loss_BT.detach(), torch.tensor([[-1.28, 0.8, 1.5, -0.5]], dtype=torch.float64))
    assert m["pg/clipfrac"] == 0.5 and m["pg/clipfrac_high"] == 0.25 and m["pg/clipfrac_low"] == 0.25
    (g,) = torch.autograd.grad(loss_BT.sum(), lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.0, 1.5, -0.5]], dtype=torch.float64))


def test_dual_clip_hand_computed():
    lp = torch.log(torch.tensor([[5.0, 1.5, 5.0]], dtype=torch.float64))
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    loss_BT, m = _per_token("dual_clip", PolicyLossInputs(lp, torch.zeros_like(lp), adv, torch.ones(1, 3)))
    # A=-1, r=5: PPO gives 5, bounded by -c*A = 3; A=-1, r=1.5: 1.5 < 3 stays; A=+1, r=5: PPO -1.28
    torch.testing.assert_close(loss_BT, torch.tensor([[3.0, 1.5, -1.28]], dtype=torch.float64))
    assert m["pg/dual_clipfrac"] == pytest.approx(1 / 3)


def test_gspo_hand_computed():
    # one sequence of two tokens, log ratios [log 2, 0] -> s = 2^(1/2) = 1.41421
    lp = torch.tensor([[math.log(2.0), 0.0], [math.log(2.0), 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss_BT, m = _per_token("gspo", PolicyLossInputs(lp, torch.zeros_like(lp), adv, torch.ones(2, 2)))
    # A=+1: clipped at 1.28 -> -1.28 per token; A=-1: -min(-1.41421, -1.28) = 1.41421 per token
    s = math.sqrt(2.0)
    torch.testing.assert_close(loss_BT, torch.tensor([[-1.28, -1.28], [s, s]], dtype=torch.float64))
    assert m["pg/clipfrac"] == 0.5 and m["pg/seq_ratio/max"] == pytest.approx(s)


def test_cispo_keeps_gradient_where_ppo_drops_it():
    lp = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    inputs = PolicyLossInputs(lp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[1.0]], dtype=torch.float64), torch.ones(1, 1))
    loss_BT, _ = _per_token("cispo", inputs)
    (g,) = torch.autograd.grad(loss_BT.sum(), lp)
    assert loss_BT.item() == pytest.approx(-1.28) and g.item() == pytest.approx(-1.28)  # sg(clip(r)) * A, negated
    ppo_BT, _ = _per_token("ppo_clip", inputs)
    (g_ppo,) = torch.autograd.grad(ppo_BT.sum(), lp)
    assert g_ppo.item() == 0.0


@pytest.mark.parametrize("clip_low", [0.2, 1.0])  # 1.0: MiniMax-M1's "no lower bound"
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cispo_keeps_its_bounded_gradient_beyond_the_log_ratio_clamp(clip_low, dtype):
    """|log r| past the +-20 clamp: values and gradients equal the slow reference (paper, verl, TRL:
    sg(clip(r)) * A * grad log pi), token by token, with A of both signs; the clamp removes nothing."""
    params = PolicyLossParams(clip_low=clip_low, clip_high=0.28)
    log_r = [25.0, 40.0, 80.0, -25.0, -40.0, -80.0, 19.0, -19.0, 0.1]
    old = torch.tensor([[-30.0 + 0.5 * i for i in range(len(log_r))]] * 2, dtype=dtype)
    lp = (old + torch.tensor([log_r, log_r], dtype=dtype)).requires_grad_(True)
    adv = torch.tensor([[1.0] * len(log_r), [-2.0] * len(log_r)], dtype=dtype)
    loss_BT, m = _per_token("cispo", PolicyLossInputs(lp, old, adv, torch.ones(2, len(log_r))), params)
    (g,) = torch.autograd.grad(loss_BT.sum(), lp)
    tol = dict(rel=1e-5, abs=1e-30) if dtype == torch.float32 else dict(rel=1e-12, abs=1e-300)
    for i in range(2):
        for t in range(len(log_r)):
            val, grad = ref_cispo_token(float(lp[i, t].detach()), float(old[i, t]), float(adv[i, t]), clip_low, 0.28)
            assert loss_BT[i, t].item() == pytest.approx(val, **tol), (i, t, log_r[t])
            assert g[i, t].item() == pytest.approx(grad, **tol), (i, t, log_r[t])
    # the tokens above the clamp carry the capped weight (1 + clip_high) * |A|, not 0
    assert g[0, 1].item() == pytest.approx(-1.28, rel=1e-6) and g[1, 2].item() == pytest.approx(2.56, rel=1e-6)
    assert m["pg/clipfrac_high"] == pytest.approx(4 / 9)


def test_the_log_ratio_clamp_removes_ppo_gradients_only_where_documented():
    """The module docstring's claim: past the clamp, ppo_clip loses the gradient only for A < 0, r > e^20
    (an unclipped -A * r term); cispo keeps all of them."""
    lp = torch.tensor([[25.0, 25.0, -25.0, -25.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    inputs = PolicyLossInputs(lp, torch.zeros_like(lp), adv, torch.ones(1, 4))
    (g_ppo,) = torch.autograd.grad(_per_token("ppo_clip", inputs)[0].sum(), lp)
    ref = [ref_ppo_token_grad(25.0, 0.0, 1.0, 0.2, 0.28), ref_ppo_token_grad(25.0, 0.0, -1.0, 0.2, 0.28),
           ref_ppo_token_grad(-25.0, 0.0, 1.0, 0.2, 0.28), ref_ppo_token_grad(-25.0, 0.0, -1.0, 0.2, 0.28)]
    assert ref[1] == pytest.approx(math.exp(25.0)) and g_ppo[0, 1].item() == 0.0  # the one real difference
    assert g_ppo[0, 0].item() == ref[0] == 0.0 and g_ppo[0, 3].item() == ref[3] == 0.0
    assert abs(ref[2]) < 2e-11 and g_ppo[0, 2].item() == 0.0  # weight e^-25: nothing of substance lost
    (g_cispo,) = torch.autograd.grad(_per_token("cispo", inputs)[0].sum(), lp)
    assert (g_cispo != 0).all()


# ----------------------------------------------------------------------------- vs loop references
def _inputs(b, is_weights=False):
    lp = b.logprobs_BT.clone().requires_grad_(True)
    w = torch.where(b.mask_BT, torch.rand(b.mask_BT.shape, dtype=torch.float64) * 2, float("nan")) if is_weights else None
    return PolicyLossInputs(lp, b.old_logprobs_BT, b.adv_BT, b.mask_BT, is_weights_BT=w), lp


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("is_weights", [False, True])
def test_ppo_and_dual_and_cispo_match_loop_values_and_grads(seed, is_weights):
    b = random_batch(seed)
    B, T = b.mask_BT.shape
    for name in ("ppo_clip", "dual_clip", "cispo"):
        inputs, lp = _inputs(b, is_weights)
        loss_BT, _ = _per_token(name, inputs)
        (g,) = torch.autograd.grad(torch.where(b.mask_BT, loss_BT, 0.0).sum(), lp)
        assert not torch.isnan(g).any(), "NaN padding leaked into gradients"
        for i in range(B):
            for t in positions(b.mask_BT, i):
                args = (float(b.logprobs_BT[i, t]), float(b.old_logprobs_BT[i, t]), float(b.adv_BT[i, t]), 0.2, 0.28)
                w = float(inputs.is_weights_BT[i, t]) if is_weights else 1.0
                if name == "ppo_clip":
                    val, grad = ref_ppo_token(*args), ref_ppo_token_grad(*args)
                elif name == "dual_clip":
                    val, grad = ref_dual_clip_token(*args, 3.0), ref_dual_clip_token_grad(*args, 3.0)
                else:
                    val, grad = ref_cispo_token(*args)
                assert loss_BT[i, t].item() == pytest.approx(w * val, rel=1e-10, abs=1e-12), (name, i, t)
                assert g[i, t].item() == pytest.approx(w * grad, rel=1e-9, abs=1e-12), (name, i, t)
            assert all(g[i, t].item() == 0.0 for t in range(T) if not bool(b.mask_BT[i, t]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_loop(seed):
    b = random_batch(seed)
    adv_B = torch.randn(b.mask_BT.shape[0], dtype=torch.float64)  # GSPO: one advantage per sequence
    inputs = PolicyLossInputs(b.logprobs_BT, b.old_logprobs_BT, adv_B, b.mask_BT)
    loss_BT, _ = _per_token("gspo", inputs)
    for i in range(b.mask_BT.shape[0]):
        pos = positions(b.mask_BT, i)
        if not pos:
            continue
        ref = ref_gspo_tokens([float(b.logprobs_BT[i, t]) for t in pos], [float(b.old_logprobs_BT[i, t]) for t in pos], [float(adv_B[i])] * len(pos), 0.2, 0.28)
        torch.testing.assert_close(loss_BT[i, pos], torch.tensor(ref, dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_gradient_equals_paper_sequence_objective(seed):
    """GSPO-token + seq_mean_token_mean has the gradient of the paper's sequence-level objective
    -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_it), written per sequence."""
    b = random_batch(seed)
    params = PolicyLossParams(clip_low=0.03, clip_high=0.04)  # narrow: some sequences clipped, some not
    adv_B = torch.randn(b.mask_BT.shape[0], dtype=torch.float64)
    lp = b.logprobs_BT.clone().requires_grad_(True)
    ours, m = compute_policy_loss("gspo", PolicyLossInputs(lp, b.old_logprobs_BT, adv_B, b.mask_BT), params, aggregation="seq_mean_token_mean")
    (g_ours,) = torch.autograd.grad(ours, lp)
    assert 0 < m["pg/clipfrac"] < 1

    lp2 = b.logprobs_BT.clone().requires_grad_(True)
    terms = []
    for i in range(b.mask_BT.shape[0]):
        pos = positions(b.mask_BT, i)
        if not pos:
            continue
        s = torch.exp((lp2[i, pos] - b.old_logprobs_BT[i, pos]).mean())
        terms.append(-torch.minimum(s * adv_B[i], s.clamp(1 - 0.03, 1 + 0.04) * adv_B[i]))
    paper = torch.stack(terms).mean()
    (g_paper,) = torch.autograd.grad(paper, lp2)
    assert ours.item() == pytest.approx(paper.item(), rel=1e-12)
    torch.testing.assert_close(torch.where(b.mask_BT, g_ours, 0.0), torch.where(b.mask_BT, g_paper, 0.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_aggregated_loss_matches_loop(seed, mode):
    b = random_batch(seed)
    inputs, _ = _inputs(b)
    loss, _ = compute_policy_loss("ppo_clip", inputs, P, aggregation=mode, domain_ids_B=b.domain_ids_B)
    per_tok = [[ref_ppo_token(float(b.logprobs_BT[i, t]), float(b.old_logprobs_BT[i, t]), float(b.adv_BT[i, t]), 0.2, 0.28) if bool(b.mask_BT[i, t]) else 0.0 for t in range(b.mask_BT.shape[1])] for i in range(b.mask_BT.shape[0])]
    assert loss.item() == pytest.approx(ref_aggregate(per_tok, b.mask_BT, mode, b.domain_ids_B.tolist()), rel=1e-10)


# ----------------------------------------------------------------------------- identities from the issue
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_with_length_one_sequences_is_token_ppo_clip(seed):
    g = torch.Generator().manual_seed(seed)
    B = 64
    lp = (-torch.rand(B, 1, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() + torch.randn(B, 1, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64)
    mask = torch.ones(B, 1)
    gspo, gm = _per_token("gspo", PolicyLossInputs(lp, old, adv, mask))
    ppo, pm = _per_token("ppo_clip", PolicyLossInputs(lp, old, adv, mask))
    torch.testing.assert_close(gspo, ppo)
    (g1,) = torch.autograd.grad(gspo.sum(), lp)
    (g2,) = torch.autograd.grad(ppo.sum(), lp)
    torch.testing.assert_close(g1, g2)
    assert gm["pg/clipfrac"] == pm["pg/clipfrac"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_ppo_without_clipping_is_vanilla_policy_gradient(seed, mode):
    """Clip ranges -> inf: grad of the PPO loss = grad of -agg(r * A), i.e. agg weight * -r * A per token
    (at r = 1 exactly REINFORCE's -A * grad log pi)."""
    b = random_batch(seed)
    inputs, lp = _inputs(b)
    huge = PolicyLossParams(clip_low=1e9, clip_high=1e9)
    loss, m = compute_policy_loss("ppo_clip", inputs, huge, aggregation=mode, domain_ids_B=b.domain_ids_B)
    (g,) = torch.autograd.grad(loss, lp)
    assert m["pg/clipfrac"] == 0.0
    lp2 = b.logprobs_BT.clone().requires_grad_(True)
    ratio = torch.exp(torch.where(b.mask_BT, lp2 - b.old_logprobs_BT, 0.0))
    vanilla, _ = aggregate(-(ratio * b.adv_BT), b.mask_BT, mode, domain_ids_B=b.domain_ids_B)
    (g_ref,) = torch.autograd.grad(vanilla, lp2)
    torch.testing.assert_close(g, g_ref)
    # and at ratio 1, the REINFORCE gradient -w * A per token
    lp1 = b.old_logprobs_BT.clone().requires_grad_(True)
    loss1, _ = compute_policy_loss("ppo_clip", PolicyLossInputs(lp1, b.old_logprobs_BT, b.adv_BT, b.mask_BT), huge, aggregation=mode, domain_ids_B=b.domain_ids_B)
    (g1,) = torch.autograd.grad(loss1, lp1)
    w_BT, _ = aggregation_weights(mode, b.mask_BT, domain_ids_B=b.domain_ids_B, dtype=torch.float64)
    torch.testing.assert_close(g1, torch.where(b.mask_BT, -w_BT * b.adv_BT, 0.0))


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_at_ratio_one_loss_is_minus_mean_advantage(name, mode):
    b = random_batch(11)
    adv = b.adv_BT if name != "gspo" else torch.where(b.mask_BT, torch.randn(b.mask_BT.shape[0], 1, dtype=torch.float64), 0.0)
    inputs = PolicyLossInputs(b.old_logprobs_BT.clone(), b.old_logprobs_BT, adv, b.mask_BT)
    loss, _ = compute_policy_loss(name, inputs, P, aggregation=mode, domain_ids_B=b.domain_ids_B)
    neg_adv = [[-x for x in row] for row in tolist2(adv)]
    assert loss.item() == pytest.approx(ref_aggregate(neg_adv, b.mask_BT, mode, b.domain_ids_B.tolist()), rel=1e-12)


# ----------------------------------------------------------------------------- robustness, errors
def test_nan_padding_does_not_leak():
    b = random_batch(3)
    for name in LOSSES:
        inputs, lp = _inputs(b)
        loss, _ = compute_policy_loss(name, inputs, P, aggregation="token_mean")
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), name


def test_errors_are_clear():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs_BT has shape \\(2, 4\\) but mask_BT has shape \\(2, 3\\)"):
        compute_policy_loss("ppo_clip", PolicyLossInputs(lp, torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="advantages_BT given per sequence has 3 entries"):
        compute_policy_loss("ppo_clip", PolicyLossInputs(lp, lp, torch.zeros(3), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; registered names: cispo, dual_clip, gspo, ppo_clip"):
        compute_policy_loss("ppo", PolicyLossInputs(lp, lp, lp, torch.ones(2, 3)))
    with pytest.raises(ValueError, match="dual_clip_c=0.5 must be > 1"):
        PolicyLossParams(dual_clip_c=0.5)
    with pytest.raises(TypeError, match="logprobs_BT: expected a floating-point tensor"):
        compute_policy_loss("ppo_clip", PolicyLossInputs(torch.zeros(2, 3, dtype=torch.long), lp, lp, torch.ones(2, 3)))
