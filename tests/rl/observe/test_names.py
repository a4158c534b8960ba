"""rl/observe/names.py: names the producers build are the names the report's loader reads back."""
from __future__ import annotations

import torch

from rl.observe import names
from rl.observe.moe import moe_telemetry, token_domain_ids


def test_moe_names_round_trip_through_the_index():
    for e, d in [(0, "swe"), (7, "rg-gcd-v0"), (123, "all"), (5, "a/b")]:
        assert names.moe_index(names.moe_load(e, d)) == names.MoeKey("load", e, d)
    assert names.moe_index(names.max_vio_layer(3, "cad")) == names.MoeKey("max_vio", 3, "cad")
    for other in ("moe/max_vio/swe", "moe/load_l01_e002/swe", "reward/mean/swe", "moe/load_e/swe", "moe/max_vio_worst/swe"):
        assert names.moe_index(other) is None, other


def test_every_indexed_name_the_moe_producer_writes_is_read_back():
    # The real producer on a small batch: 2 domains, 4 experts, 3 layers, top-2.
    g = torch.Generator().manual_seed(0)
    L, N, K, E = 3, 40, 2, 4
    routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L * N)]).view(L, N, K)
    dom_B = torch.tensor([0, 1, 0, 1])
    out = moe_telemetry(routes, token_domain_ids(dom_B, N // 4), ("cad", "swe"), E)
    idx = [m for k in out if (m := names.moe_index(k)) is not None]
    assert {(m.kind, m.index, m.domain) for m in idx} == (
        {("load", e, d) for e in range(E) for d in ("cad", "swe", "all")}
        | {("max_vio", l, d) for l in range(L) for d in ("cad", "swe", "all")})


def test_split_domain_knows_only_the_given_domains():
    doms = {"swe", "rg-gcd-v0"}
    assert names.split_domain("reward/mean/swe", doms) == ("reward/mean", "swe")
    assert names.split_domain("reward/mean/all", doms) == ("reward/mean", "all")
    assert names.split_domain("episode/wall_s/max", doms) is None  # a stat name, not a domain
    assert names.split_domain("swe", doms) is None
    assert names.split_domain(names.per_domain("tokens/response_p50", "rg-gcd-v0"), doms) == ("tokens/response_p50", "rg-gcd-v0")


def test_legacy_domains_are_reward_series_only():
    keys = ["reward/mean/terminal", "reward/mean/all", "episode/wall_s/max", "tokens/response/mean", "moe/load_e000/x"]
    assert names.legacy_domains(keys) == ("terminal",)


def test_split_domain_takes_domains_holding_a_slash():
    doms = {"web/search", "max", "b"}
    assert names.split_domain("reward/mean/web/search", doms) == ("reward/mean", "web/search")
    assert names.split_domain("episode/wall_s/max", doms) == ("episode/wall_s", "max")  # `max` is a domain here
    assert names.split_domain("reward/mean/a/b", doms) == ("reward/mean/a", "b")  # the shortest suffix wins
    assert names.split_domain("train/grad_norm", doms) is None
    assert names.split_domain("web/search", doms) is None  # a domain alone has no stat
