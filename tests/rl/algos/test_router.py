"""Router aux (load-balance) and z-loss vs loop references and transformers' Mixtral load_balancing_loss_func."""
from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from tests.rl.algos.algos_refs import ref_load_balance, ref_z_loss
from rl.algos.router import load_balance_loss, router_losses, router_z_loss


def _routes(seed, L=3, N=40, E=8, K=2):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, N, E, generator=g, dtype=torch.float64) * 2
    replayed = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]) for _ in range(L)])
    mask = torch.rand(N, generator=g) > 0.2
    return logits, replayed, mask


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("count_per", ["assignment", "token"])
@pytest.mark.parametrize("layer_reduction", ["mean", "pooled"])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balance_matches_loop_with_replayed_routes(seed, count_per, layer_reduction, masked):
    logits, ids, mask = _routes(seed)
    m = mask if masked else None
    aux, _ = load_balance_loss(logits, ids, m, count_per=count_per, layer_reduction=layer_reduction)
    ref = ref_load_balance(logits, ids, mask.tolist() if masked else [True] * logits.shape[1], count_per, layer_reduction)
    assert aux.item() == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("with_mask", [False, True])
def test_equals_transformers_mixtral_when_configured_alike(seed, top_k, with_mask):
    """HF pools layers and counts per token (uniform routing gives top_k): our count_per='token',
    layer_reduction='pooled', with the top-k of the same logits as the routes."""
    L, B, T, E = 3, 2, 9, 8
    g = torch.Generator().manual_seed(seed)
    gate_logits = tuple(torch.randn(B * T, E, generator=g) for _ in range(L))
    attn = (torch.rand(B, T, generator=g) > 0.3).long() if with_mask else None
    hf = load_balancing_loss_func(gate_logits, E, top_k, attn)
    topk = [torch.topk(torch.softmax(x, -1), top_k, dim=-1).indices for x in gate_logits]
    ours, _ = load_balance_loss(list(gate_logits), topk, attn.reshape(-1) if with_mask else None, count_per="token", layer_reduction="pooled")
    assert ours.item() == pytest.approx(hf.item(), rel=1e-5)
    # the Switch / Megatron normalisation is HF's value divided by top_k
    ours_assign, _ = load_balance_loss(list(gate_logits), topk, attn.reshape(-1) if with_mask else None, count_per="assignment", layer_reduction="pooled")
    assert ours_assign.item() == pytest.approx(hf.item() / top_k, rel=1e-5)
    # ...only with layer_reduction="pooled": the default "mean" averages per-layer products f_l . P_l,
    # which is not the product of the pooled f and P once layers route differently
    ours_mean, _ = load_balance_loss(list(gate_logits), topk, attn.reshape(-1) if with_mask else None, count_per="assignment")
    assert abs(ours_mean.item() - hf.item() / top_k) > 1e-4


def test_uniform_routing_gives_one_and_gradient_reaches_logits_only_through_P():
    L, N, E, K = 2, 16, 4, 2
    logits = torch.zeros(L, N, E, requires_grad=True)
    ids = torch.tensor([[(2 * n) % E, (2 * n + 1) % E] for n in range(N)]).expand(L, N, K)
    aux, m = load_balance_loss(logits, ids, count_per="assignment")
    assert aux.item() == pytest.approx(1.0) and m["router/max_load"] == pytest.approx(1.0)
    # replayed routes all on expert 0 -> the loss pushes probability away from expert 0
    skew = torch.zeros(L, N, K, dtype=torch.long)
    aux, m = load_balance_loss(logits, skew)
    (g,) = torch.autograd.grad(aux, logits)
    assert (g[..., 0] > 0).all() and (g[..., 1:] < 0).all()
    assert m["router/max_load"] == pytest.approx(E) and m["router/unused_expert_frac"] == pytest.approx(0.75)


@pytest.mark.parametrize("masked", [False, True])
def test_z_loss_matches_loop(masked):
    logits, _, mask = _routes(5)
    z, _ = router_z_loss(logits, mask if masked else None)
    assert z.item() == pytest.approx(ref_z_loss(logits, mask.tolist() if masked else [True] * logits.shape[1]), rel=1e-12)


def test_router_losses_weights_and_always_logs():
    logits, ids, mask = _routes(6)
    total, m = router_losses(logits, ids, mask, aux_coef=0.0, z_coef=0.0)
    assert total.item() == 0.0 and m["router/aux_loss"] > 0 and m["router/z_loss"] > 0  # logged even when off
    total, m = router_losses(logits, ids, mask, aux_coef=0.01, z_coef=0.001)
    aux, _ = load_balance_loss(logits, ids, mask)
    z, _ = router_z_loss(logits, mask)
    assert total.item() == pytest.approx(0.01 * aux.item() + 0.001 * z.item(), rel=1e-12)


def test_router_errors():
    logits, ids, mask = _routes(7, E=4)
    with pytest.raises(ValueError, match="expert_ids out of range: found ids in \\[1, 4\\] but there are 4 experts"):
        load_balance_loss(logits, torch.where(ids == 0, 4, ids))
    with pytest.raises(ValueError, match="expert_ids has shape \\(2, 40, 2\\); expected \\[L=3, N=40"):
        load_balance_loss(logits, ids[:2])
    with pytest.raises(ValueError, match="token_mask_N has 39 entries"):
        load_balance_loss(logits, ids, mask[:39])
    with pytest.raises(TypeError, match="expert_ids: expected an integer tensor"):
        load_balance_loss(logits, ids.float())
    with pytest.raises(ValueError, match="router_logits\\[1\\] has shape"):
        router_z_loss([logits[0], logits[1, :5]])
