"""KL estimators, train/inference mismatch correction and the clipped value loss vs hand cases and loops."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.rl.algos.algos_refs import positions, random_batch, ref_aggregate, ref_kl, ref_value_token, tolist2
from rl.algos.kl import KL_ESTIMATORS, kl_loss, kl_per_token, kl_reward_penalty
from rl.algos.off_policy import masked_is_mask, truncated_is_weights
from rl.algos.value import clipped_value_loss


# ----------------------------------------------------------------------------- KL
def test_kl_hand_computed():
    # pi(y) = 0.5, ref(y) = 0.25: log r = log 0.5
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    one = torch.ones(1, 1)
    k1, _ = kl_per_token(lp, ref, one, "k1")
    k2, _ = kl_per_token(lp, ref, one, "k2")
    k3, _ = kl_per_token(lp, ref, one, "k3")
    assert k1.item() == pytest.approx(math.log(2))  # 0.693147
    assert k2.item() == pytest.approx(0.5 * math.log(2) ** 2)  # 0.240227
    assert k3.item() == pytest.approx(0.5 - 1 + math.log(2))  # 0.193147


def test_k1_k3_are_exactly_unbiased_on_a_categorical():
    """sum_x pi(x) k(x) = KL(pi || ref) for k1 and k3 (the estimators' defining property), checked
    against torch's own kl_div; k2's expectation is not the KL (it is >= 0 and differs)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(1, 50, generator=g, dtype=torch.float64), -1)
    logref = torch.log_softmax(torch.randn(1, 50, generator=g, dtype=torch.float64), -1)
    true_kl = F.kl_div(logref, logp, log_target=True, reduction="sum")  # sum p (log p - log ref)
    mask = torch.ones(1, 50)
    p = logp.exp()
    for est in ("k1", "k3"):
        k, _ = kl_per_token(logp, logref, mask, est, clamp=None)
        assert (p * k).sum().item() == pytest.approx(true_kl.item(), rel=1e-10)
    k2, _ = kl_per_token(logp, logref, mask, "k2", clamp=None)
    assert abs((p * k2).sum().item() - true_kl.item()) > 1e-3


def test_kl_estimators_as_losses_have_these_expected_gradients():
    """Used as a loss on tokens sampled from pi (the sample fixed, gradient through log pi only), the
    expected gradient sum_y pi(y) grad k(y) is, exactly: k3 -> grad KL(ref || pi) (not KL(pi || ref): the
    value estimates one KL, the gradient follows the other, as with TRL's and verl's low_var_kl);
    k2 -> grad KL(pi || ref); k1 -> 0. Checked by enumeration over a 7-token vocabulary."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    logref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    mask = torch.ones(1, 7)

    def grad(f):
        (gr,) = torch.autograd.grad(f(torch.log_softmax(theta, -1)), theta)
        return gr

    def expected_grad(est):
        def f(logp):
            k, _ = kl_per_token(logp[None], logref[None], mask, est, clamp=None)
            return (logp.exp().detach() * k[0]).sum()
        return grad(f)

    fwd = grad(lambda logp: (logp.exp() * (logp - logref)).sum())  # KL(pi || ref)
    rev = grad(lambda logp: (logref.exp() * (logref - logp)).sum())  # KL(ref || pi)
    assert (fwd - rev).abs().max() > 1e-2  # the two gradients differ here
    torch.testing.assert_close(expected_grad("k3"), rev, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(expected_grad("k2"), fwd, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(7, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_matches_loop_and_has_gradient_only_on_mask(estimator):
    b = random_batch(0)
    lp = b.logprobs_BT.clone().requires_grad_(True)
    kl_BT, _ = kl_per_token(lp, b.old_logprobs_BT, b.mask_BT, estimator)
    for i in range(b.mask_BT.shape[0]):
        for t in positions(b.mask_BT, i):
            assert kl_BT[i, t].item() == pytest.approx(ref_kl(float(b.logprobs_BT[i, t]), float(b.old_logprobs_BT[i, t]), estimator), rel=1e-12, abs=1e-15)
    loss, m = kl_loss(lp, b.old_logprobs_BT, b.mask_BT, estimator=estimator, coef=0.1, aggregation="seq_mean_token_mean")
    ref = ref_aggregate(tolist2(torch.where(b.mask_BT, kl_BT.detach(), 0.0)), b.mask_BT, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(0.1 * ref, rel=1e-12)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(g).all() and (g[~b.mask_BT] == 0).all()
    assert m["kl/value"] == pytest.approx(ref)


def test_kl_reward_penalty_is_detached_negative_kl():
    b = random_batch(1)
    lp = b.logprobs_BT.clone().requires_grad_(True)
    pen, _ = kl_reward_penalty(lp, b.old_logprobs_BT, b.mask_BT, coef=0.05, estimator="k1")
    assert not pen.requires_grad
    kl, _ = kl_per_token(b.logprobs_BT, b.old_logprobs_BT, b.mask_BT, "k1")
    torch.testing.assert_close(pen, -0.05 * kl)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; registered names: k1, k2, k3"):
        kl_per_token(lp, lp, b.mask_BT, "k4")
    assert KL_ESTIMATORS.names() == ("k1", "k2", "k3")


# ----------------------------------------------------------------------------- off-policy correction
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cap", [1.2, 2.0])
def test_tis_token_level_matches_loop(seed, cap):
    b = random_batch(seed)
    w, m = truncated_is_weights(b.old_logprobs_BT, b.rollout_logprobs_BT, b.mask_BT, cap=cap, level="token")
    capped, total = 0, 0
    for i in range(b.mask_BT.shape[0]):
        for t in range(b.mask_BT.shape[1]):
            if not bool(b.mask_BT[i, t]):
                assert w[i, t].item() == 0.0
                continue
            rho = math.exp(float(b.old_logprobs_BT[i, t]) - float(b.rollout_logprobs_BT[i, t]))
            assert w[i, t].item() == pytest.approx(min(rho, cap), rel=1e-12)
            capped += rho > cap
            total += 1
    assert m["offpolicy/tis_capped_frac"] == pytest.approx(capped / total)
    assert 0 < capped < total


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_tis_sequence_levels_match_loop(level):
    b = random_batch(2)
    cap = 1.5
    w, m = truncated_is_weights(b.old_logprobs_BT, b.rollout_logprobs_BT, b.mask_BT, cap=cap, level=level)
    n_capped, n_seq = 0, 0
    for i in range(b.mask_BT.shape[0]):
        pos = positions(b.mask_BT, i)
        if not pos:
            assert (w[i] == 0).all()
            continue
        log_rho = sum(float(b.old_logprobs_BT[i, t]) - float(b.rollout_logprobs_BT[i, t]) for t in pos)
        if level == "geometric":
            log_rho /= len(pos)
        expected = cap if log_rho > math.log(cap) else math.exp(log_rho)  # compare in log space: no overflow
        for t in pos:
            assert w[i, t].item() == pytest.approx(expected, rel=1e-12)
        n_capped += log_rho > math.log(cap)
        n_seq += 1
    assert m["offpolicy/tis_capped_frac"] == pytest.approx(n_capped / n_seq)


def test_tis_sequence_product_does_not_overflow():
    T = 4000
    old = torch.full((1, T), -1.0, dtype=torch.float32)
    roll = torch.full((1, T), -1.5, dtype=torch.float32)  # product of ratios = e^2000
    w, _ = truncated_is_weights(old, roll, torch.ones(1, T), cap=2.0, level="sequence")
    assert torch.isfinite(w).all() and w.max().item() == pytest.approx(2.0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mis_matches_loop(level):
    b = random_batch(3)
    low, high = {"token": (0.7, 1.3), "sequence": (0.5, 2.0), "geometric": (0.9, 1.1)}[level]
    new_mask, m = masked_is_mask(b.old_logprobs_BT, b.rollout_logprobs_BT, b.mask_BT, low=low, high=high, level=level)
    dropped = 0
    for i in range(b.mask_BT.shape[0]):
        pos = positions(b.mask_BT, i)
        seq_log = sum(float(b.old_logprobs_BT[i, t]) - float(b.rollout_logprobs_BT[i, t]) for t in pos)
        if level == "geometric":
            seq_log /= max(len(pos), 1)
        for t in range(b.mask_BT.shape[1]):
            if t not in pos:
                assert not bool(new_mask[i, t])
                continue
            log_rho = float(b.old_logprobs_BT[i, t]) - float(b.rollout_logprobs_BT[i, t]) if level == "token" else seq_log
            keep = math.log(low) <= log_rho <= math.log(high)
            assert bool(new_mask[i, t]) == keep
            dropped += not keep
    assert m["offpolicy/mis_masked_token_frac"] == pytest.approx(dropped / int(b.mask_BT.sum()))
    assert 0 < dropped < int(b.mask_BT.sum())


def test_mismatch_metrics_and_errors():
    b = random_batch(4)
    _, m = truncated_is_weights(b.old_logprobs_BT, b.old_logprobs_BT, b.mask_BT)
    assert m["offpolicy/mismatch_kl_k3"] == 0.0 and m["offpolicy/tis_capped_frac"] == 0.0
    _, m = truncated_is_weights(b.old_logprobs_BT, b.rollout_logprobs_BT, b.mask_BT)
    assert m["offpolicy/mismatch_kl_k3"] > 0
    with pytest.raises(ValueError, match="cap=0 must be > 0"):
        truncated_is_weights(b.old_logprobs_BT, b.rollout_logprobs_BT, b.mask_BT, cap=0)
    with pytest.raises(ValueError, match="level='tok' is not one of"):
        truncated_is_weights(b.old_logprobs_BT, b.rollout_logprobs_BT, b.mask_BT, level="tok")
    with pytest.raises(ValueError, match="need 0 < low <= 1 <= high"):
        masked_is_mask(b.old_logprobs_BT, b.rollout_logprobs_BT, b.mask_BT, low=1.5, high=2.0)


# ----------------------------------------------------------------------------- value loss
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_clipped_value_loss_matches_loop(seed, mode):
    b = random_batch(seed)
    g = torch.Generator().manual_seed(seed)
    v = (b.values_BT + torch.randn(b.mask_BT.shape, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    ret = torch.where(b.mask_BT, torch.randn(b.mask_BT.shape, generator=g, dtype=torch.float64), float("nan"))
    loss, m = clipped_value_loss(v, b.values_BT, ret, b.mask_BT, clip=0.2, aggregation=mode)
    per_tok = [[ref_value_token(float(v.detach()[i, t]), float(b.values_BT[i, t]), float(ret[i, t]), 0.2) if bool(b.mask_BT[i, t]) else 0.0 for t in range(b.mask_BT.shape[1])] for i in range(b.mask_BT.shape[0])]
    assert loss.item() == pytest.approx(ref_aggregate(per_tok, b.mask_BT, mode), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, v)
    assert torch.isfinite(grad).all() and (grad[~b.mask_BT] == 0).all()
    assert 0 < m["vf/clipfrac"] < 1


def test_value_loss_hand_computed():
    v = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    # token 0: v moved 1 away from old toward nothing: unclipped err 1, clipped (0.2 - 0)^2 = .04 -> max 1 -> .5
    # token 1: v = old = 0: both errors 1 -> .5
    loss, m = clipped_value_loss(v, old, ret, torch.ones(1, 2), clip=0.2)
    assert loss.item() == pytest.approx(0.5)
    # clipping the update keeps the larger (pessimistic) error: v=1 toward ret=1.5 from old=0 -> clipped .2: (1.3)^2
    loss, m = clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.5]]), torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 1.3**2) and m["vf/clipfrac"] == 1.0
