"""Benchmark the dashboard pieces, figures side by side in one run.

1. MoE telemetry per micro-batch (rl/moe_telemetry.moe_batch_stats, vectorised) vs an obvious per-domain /
   per-layer loop in torch, and vs the tiny HybridMoe's own forward on the same micro-batch (the overhead the
   trainer pays for per-domain MoE metrics).
2. rollout_metrics on a step's episodes.
3. `jointrl report` on a long run (load + render), with the page size.

Run: .venv/bin/python scripts/bench_dashboards.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "rl" / "observe"))


def timeit(fn, reps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def loop_stats(routes, dom, mask, logits, D, E):
    """The obvious version: one masked selection per (domain, layer)."""
    L = routes.shape[0]
    counts = np.zeros((D, L, E))
    prob = np.zeros((D, L, E))
    ent = np.zeros((D, L))
    for d in range(D):
        sel = mask & (dom == d)
        for l in range(L):
            counts[d, l] = torch.bincount(routes[l, sel].reshape(-1), minlength=E).numpy()
            p = torch.softmax(logits[l, sel].double(), -1)
            prob[d, l] = p.sum(0).numpy()
            ent[d, l] = float(-(p * p.clamp_min(1e-30).log()).sum())
    return counts, prob, ent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from rl.observe.moe import moe_batch_stats, moe_metrics

    rows = []
    # 1. MoE telemetry
    L, B, T, E, K, D = 8, 8, 512, 64, 4, 4
    g = torch.Generator().manual_seed(0)
    N = B * T
    logits = torch.randn(L, N, E, generator=g)
    routes = logits.topk(K, -1).indices
    dom = torch.randint(0, D, (N,), generator=g)
    mask = torch.rand(N, generator=g) < 0.9
    doms = tuple(f"d{i}" for i in range(D))
    reps = 3 if args.quick else 10
    t_vec = timeit(lambda: moe_batch_stats(routes, dom, doms, E, token_mask_N=mask, router_logits=logits, fresh_routes_LNK=routes), reps)
    t_loop = timeit(lambda: loop_stats(routes, dom, mask, logits, D, E), reps)
    st = moe_batch_stats(routes, dom, doms, E, token_mask_N=mask, router_logits=logits)
    c, p, _ = loop_stats(routes, dom, mask, logits, D, E)
    assert np.allclose(st.counts_DLE, c) and np.allclose(st.prob_sum_DLE, p, rtol=1e-5)
    t_met = timeit(lambda: moe_metrics(st), reps)
    rows.append((f"moe_batch_stats L={L} N={N} E={E} K={K} D={D} (+replay)", t_vec, f"{t_loop / t_vec:.2f}x faster than per-domain loop ({t_loop * 1e3:.1f} ms)"))
    rows.append(("moe_metrics (finalise, all names)", t_met, f"{len(moe_metrics(st))} metrics"))

    import model  # noqa: F401
    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.observe.moe import fresh_routes, moe_batch_stats as mbs, token_domain_ids

    cfg = load_shipped_config("tiny")
    m = HybridMoeForCausalLM(cfg).eval()
    Bm, Tm = 4, 256
    ids = torch.randint(5, cfg.vocab_size, (Bm, Tm), generator=g)
    with torch.no_grad():
        t_fwd = timeit(lambda: m(input_ids=ids, output_router_logits=True), 2 if args.quick else 4)
        out = m(input_ids=ids, output_router_logits=True)
    dom_m = token_domain_ids(torch.arange(Bm) % 3, Tm)

    def tele():
        fr = fresh_routes(out.router_logits, cfg.num_experts_per_tok)
        return mbs(out.routed_experts, dom_m, ("a", "b", "c"), cfg.num_experts, router_logits=out.router_logits, fresh_routes_LNK=fr)

    t_tele = timeit(tele, reps)
    rows.append((f"tiny HybridMoe forward B={Bm} T={Tm}", t_fwd, "reference"))
    rows.append(("  + MoE telemetry on its outputs", t_tele, f"{100 * t_tele / t_fwd:.1f}% of the forward"))

    # 2. rollout metrics
    from dash_synth import make_groups
    from rl.observe.telemetry import rollout_metrics

    rng = np.random.default_rng(0)
    groups = make_groups(rng, 3, tasks_per_domain=8, G=8)
    n_eps = sum(len(gr.episodes) for gr in groups)
    t_roll = timeit(lambda: rollout_metrics(groups, (4, 5), policy_version=3), reps)
    rows.append((f"rollout_metrics {n_eps} episodes, 3 domains", t_roll, f"{len(rollout_metrics(groups, (4, 5)))} metrics"))

    # 3. report on a long run
    from dash_synth import build_run
    from rl.observe import report

    steps = 60 if args.quick else 300
    with tempfile.TemporaryDirectory() as td:
        t0 = time.perf_counter()
        build_run(Path(td) / "r", steps=steps)
        t_build = time.perf_counter() - t0
        t_load = timeit(lambda: report.load_run(Path(td) / "r"), 1)
        run = report.load_run(Path(td) / "r")
        t_render = timeit(lambda: report.render_report(run), 1)
        size = len(report.render_report(run).encode())
        rows.append((f"synthetic run: {steps} steps x {len(run.series)} metrics written via MetricsSink", t_build, "setup"))
        rows.append(("report: load_run", t_load, f"metrics.jsonl {(Path(td) / 'r' / 'metrics.jsonl').stat().st_size / 1e6:.1f} MB"))
        rows.append(("report: render_report", t_render, f"page {size / 1e6:.2f} MB"))

    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'time':>10}  note")
    for name, t, note in rows:
        print(f"{name:<{w}}  {t * 1e3:>8.2f}ms  {note}")


if __name__ == "__main__":
    main()
