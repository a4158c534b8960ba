"""Loss aggregation modes vs a loop reference, and the per-domain normalisation property."""
from __future__ import annotations

import pytest
import torch

from tests.rl.algos.algos_refs import random_batch, ref_aggregate, tolist2
from rl.algos.aggregation import AGGREGATIONS, aggregate, aggregation_weights, reduce

MODES = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "domain_token_mean"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_loop(seed, mode):
    b = random_batch(seed)
    loss = torch.where(b.mask_BT, torch.randn(b.mask_BT.shape, dtype=torch.float64), float("nan"))  # NaN off the mask
    out, _ = aggregate(loss, b.mask_BT, mode, domain_ids_B=b.domain_ids_B)
    assert out.item() == pytest.approx(ref_aggregate(tolist2(loss), b.mask_BT, mode, b.domain_ids_B.tolist()), rel=1e-12)


def test_domain_weights_are_applied_and_reported():
    b = random_batch(5)
    loss = torch.randn(b.mask_BT.shape, dtype=torch.float64)
    dw = {0: 1.0, 10: 3.0, 20: 0.5}
    names = {0: "terminal", 10: "swe", 20: "browse"}
    out, m = aggregate(loss, b.mask_BT, "domain_token_mean", domain_ids_B=b.domain_ids_B, domain_weights=dw, domain_names=names)
    assert out.item() == pytest.approx(ref_aggregate(tolist2(loss), b.mask_BT, "domain_token_mean", b.domain_ids_B.tolist(), dw), rel=1e-12)
    assert m["agg/domain_share/swe"] == pytest.approx(3.0 / 4.5)
    assert m["agg/domain_share/browse"] == pytest.approx(0.5 / 4.5)
    assert sum(v for k, v in m.items() if k.startswith("agg/domain_share/")) == pytest.approx(1.0)


def _domain_grad_shares(mask_BT, domain_ids_B, mode):
    """d loss / d loss_BT summed per domain: each domain's share of the gradient; and the per-token weights."""
    loss = torch.randn(mask_BT.shape, dtype=torch.float64, requires_grad=True)
    out, _ = aggregate(loss, mask_BT, mode, domain_ids_B=domain_ids_B)
    (g,) = torch.autograd.grad(out, loss)
    shares = {int(d): float(g[domain_ids_B == d].sum()) for d in torch.unique(domain_ids_B)}
    return shares, g


def _double_lengths(mask_BT, rows):
    """Each row in `rows` gets its generated pattern repeated twice (twice the generated tokens)."""
    B, T = mask_BT.shape
    new = torch.zeros(B, 2 * T, dtype=torch.bool)
    new[:, :T] = mask_BT
    for b in rows:
        new[b, T:] = mask_BT[b]
    return new


def test_domain_normalisation_doubling_one_domain_leaves_others_unchanged():
    b = random_batch(6, n_groups=6, n_domains=3, empty_row=False)
    swe = 10
    rows = [i for i in range(len(b.domain_ids_B)) if int(b.domain_ids_B[i]) == swe]
    longer = _double_lengths(b.mask_BT, rows)
    assert longer[rows].sum() == 2 * b.mask_BT[rows].sum()

    before, g_before = _domain_grad_shares(b.mask_BT, b.domain_ids_B, "domain_token_mean")
    after, g_after = _domain_grad_shares(longer, b.domain_ids_B, "domain_token_mean")
    for d in before:
        assert after[d] == pytest.approx(before[d], rel=1e-12), f"domain {d} share changed"
    others = [i for i in range(len(b.domain_ids_B)) if int(b.domain_ids_B[i]) != swe]
    # every token of the other domains keeps exactly its gradient weight
    torch.testing.assert_close(g_after[others][:, : b.mask_BT.shape[1]], g_before[others])

    # the same experiment under token_mean moves gradient toward the lengthened domain: the property is not vacuous
    tb, _ = _domain_grad_shares(b.mask_BT, b.domain_ids_B, "token_mean")
    ta, _ = _domain_grad_shares(longer, b.domain_ids_B, "token_mean")
    assert ta[swe] > tb[swe] + 0.05
    assert all(ta[d] < tb[d] for d in ta if d != swe)


def test_weights_sliced_over_micro_batches_sum_to_full_batch():
    b = random_batch(7)
    loss = torch.randn(b.mask_BT.shape, dtype=torch.float64)
    for mode in MODES:
        w, _ = aggregation_weights(mode, b.mask_BT, domain_ids_B=b.domain_ids_B, dtype=torch.float64)
        full, _ = aggregate(loss, b.mask_BT, mode, domain_ids_B=b.domain_ids_B)
        parts = sum(reduce(loss[s], w[s], b.mask_BT[s]) for s in (slice(0, 7), slice(7, 13), slice(13, None)))
        assert parts.item() == pytest.approx(full.item(), rel=1e-12)


def test_empty_domain_and_errors():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    loss = torch.tensor([[1.0, 3.0, 0.0], [9.0, 9.0, 9.0]])
    out, m = aggregate(loss, mask, "domain_token_mean", domain_ids_B=torch.tensor([0, 1]))
    assert out.item() == 2.0 and m["agg/domain_share/1"] == 0.0
    with pytest.raises(ValueError, match="needs domain_ids_B"):
        aggregate(loss, mask, "domain_token_mean")
    with pytest.raises(ValueError, match="no weight for domain id\\(s\\) \\[1\\]"):
        aggregate(loss, mask, "domain_token_mean", domain_ids_B=torch.tensor([0, 1]), domain_weights={0: 1.0})
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'; registered names: domain_token_mean, seq_mean_token_mean"):
        aggregate(loss, mask, "mean")
    with pytest.raises(ValueError, match="weights_BT has shape \\(2, 3\\) but loss_BT has shape \\(2, 2\\)"):
        reduce(loss[:, :2], torch.ones(2, 3), mask)
    assert set(AGGREGATIONS.names()) == set(MODES)
