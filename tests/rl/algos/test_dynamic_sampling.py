"""Zero-variance group detection per domain (rl/algos/dynamic_sampling.py)."""
from __future__ import annotations

import pytest
import torch

from tests.rl.algos.algos_refs import random_batch
from rl.algos.dynamic_sampling import group_signal, zero_variance_groups


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_zero_variance_groups_match_loop(seed):
    b = random_batch(seed, n_groups=9, group_size=3)
    keep, m = zero_variance_groups(b.rewards_B, b.group_ids_B, b.domain_ids_B, domain_names={0: "terminal", 10: "swe", 20: "browse"})
    rewards, groups, domains = b.rewards_B.tolist(), b.group_ids_B.tolist(), b.domain_ids_B.tolist()
    by_group: dict[int, list[float]] = {}
    dom_of: dict[int, int] = {}
    for r, gid, d in zip(rewards, groups, domains):
        by_group.setdefault(gid, []).append(r)
        dom_of[gid] = d
    zero = {gid: max(rs) == min(rs) for gid, rs in by_group.items()}
    assert keep.tolist() == [not zero[gid] for gid in groups]
    assert m["dynsample/zero_var_group_frac"] == pytest.approx(sum(zero.values()) / len(zero))
    for d, name in {0: "terminal", 10: "swe", 20: "browse"}.items():
        in_d = [gid for gid in by_group if dom_of[gid] == d]
        if in_d:
            assert m[f"dynsample/zero_var_group_frac/{name}"] == pytest.approx(sum(zero[gid] for gid in in_d) / len(in_d))
    assert any(zero.values())  # random_batch makes group 0 all-equal


def test_atol_and_singletons_and_errors():
    r = torch.tensor([1.0, 1.0 + 1e-9, 0.0, 0.5])
    keep, _ = zero_variance_groups(r, torch.tensor([0, 0, 1, 1]), atol=1e-6)
    assert keep.tolist() == [False, False, True, True]
    keep, _ = zero_variance_groups(torch.tensor([3.0]), torch.tensor([0]))
    assert keep.tolist() == [False]
    with pytest.raises(ValueError, match="group 0 mixes domains"):
        zero_variance_groups(r, torch.tensor([0, 0, 1, 1]), torch.tensor([1, 2, 1, 1]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_signal_matches_a_loop_over_groups(seed):
    g = torch.Generator().manual_seed(seed)
    labels = ["swe", "terminal", "cad"]
    rewards_G, labels_G = [], []
    for i in range(12):
        n = int(torch.randint(1, 5, (1,), generator=g))
        same = bool(torch.rand(1, generator=g) < 0.4)
        r = [0.5] * n if same else [round(float(x), 2) for x in torch.rand(n, generator=g)]
        rewards_G.append(r)
        labels_G.append(labels[i % 3])
    sig = group_signal(rewards_G, labels_G)
    want_signal = tuple(max(r) != min(r) for r in rewards_G)  # from the rule: any two rewards differ
    assert sig.has_signal_G == want_signal
    want = {d: sum(not s for s, x in zip(want_signal, labels_G) if x == d) / labels_G.count(d) for d in sorted(labels)}
    assert sig.zero_var_frac == pytest.approx(want) and list(sig.zero_var_frac) == sorted(labels)
    assert sig.metrics() == {f"rollout/zero_var_frac/{d}": f for d, f in sig.zero_var_frac.items()}
    assert any(want_signal) and not all(want_signal)


def test_group_signal_edges():
    assert group_signal([], []).has_signal_G == () and group_signal([], []).metrics() == {}
    assert group_signal([[1.0, 1.0 + 1e-9]], ["a"], atol=1e-6).has_signal_G == (False,)
    with pytest.raises(ValueError, match="group 1 has no rewards"):
        group_signal([[1.0], []], ["a", "a"])
    with pytest.raises(ValueError, match="2 reward groups but 1 labels"):
        group_signal([[1.0], [0.0]], ["a"])
