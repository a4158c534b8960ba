"""Random MoE routing cases for the telemetry tests, and the 2-rank all-reduce worker.

Kept light (torch + rl.observe.moe only) because spawned worker processes import this module.
"""
from __future__ import annotations

import torch

DOMS = ("a", "b", "c")


def random_case(seed, L=3, N=40, E=6, K=2, D=3, pad_frac=0.25, skip_domain=None):
    """routes [L,N,K] (top-k of logits, -1 on padding), domain ids [N], mask [N], logits [L,N,E] fp64, and
    'fresh' routes from perturbed logits (so some differ)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, N, E, generator=g, dtype=torch.float64) * 2
    routes = logits.topk(K, dim=-1).indices
    fresh = (logits + 0.7 * torch.randn(L, N, E, generator=g, dtype=torch.float64)).topk(K, dim=-1).indices
    dom = torch.randint(0, D, (N,), generator=g)
    if skip_domain is not None:
        dom = torch.where(dom == skip_domain, (dom + 1) % D, dom)
    mask = torch.rand(N, generator=g) >= pad_frac
    routes = torch.where(mask[None, :, None], routes, torch.full_like(routes, -1))  # padding carries -1 like collate()
    return routes, dom, mask, logits, fresh


def all_reduce_worker(rank, port, q):
    import torch.distributed as dist

    from rl.observe.moe import all_reduce_stats, moe_batch_stats, moe_metrics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        routes, dom, mask, logits, _ = random_case(11, N=40)
        s = slice(0, 15) if rank == 0 else slice(15, 40)
        st = all_reduce_stats(moe_batch_stats(routes[:, s], dom[s], DOMS, 6, token_mask_N=mask[s], router_logits=logits[:, s]))
        q.put((rank, moe_metrics(st)))
    finally:
        dist.destroy_process_group()
