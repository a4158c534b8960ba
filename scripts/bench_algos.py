"""Benchmark rl/algos: vectorised functions vs the slow loop references used as test oracles, and
the router aux loss vs transformers' Mixtral load_balancing_loss_func. Prints figures side by side.

Run: .venv/bin/python scripts/bench_algos.py [--threads N]
The loop references are tests/rl/algos/algos_refs.py (pure Python); sizes are kept small enough that the
whole run takes well under a minute on 2 cores. Not a test: numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.rl.algos.algos_refs import random_batch, ref_aggregate, ref_gae, ref_grpo, ref_ppo_token, tolist2  # noqa: E402
from rl.algos import (  # noqa: E402
    AdvantageInputs,
    PolicyLossInputs,
    PolicyLossParams,
    compute_advantages,
    compute_policy_loss,
    gae_advantages_BT,
    load_balance_loss,
    truncated_is_weights,
)


def timeit(fn: Callable[[], object], min_s: float = 0.3, max_reps: int = 200) -> float:
    fn()  # warm-up
    reps, t0 = 0, time.perf_counter()
    while reps < max_reps:
        fn()
        reps += 1
        if time.perf_counter() - t0 > min_s:
            break
    return (time.perf_counter() - t0) / reps


def row(name: str, fast_s: float, other_s: float, other_name: str) -> None:
    print(f"{name:<42} {fast_s * 1e3:>10.3f} ms  {other_name:<22} {other_s * 1e3:>10.3f} ms  ratio {other_s / fast_s:>8.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'function (size)':<42} {'rl.algos':>13}  {'reference':<22} {'':>13}")

    # GRPO advantages: 256 groups x 8 samples
    b = random_batch(0, n_groups=256, group_size=8, T=16)
    inp = AdvantageInputs(b.rewards_B, b.mask_BT, b.group_ids_B)
    r, g = b.rewards_B.tolist(), b.group_ids_B.tolist()
    row("grpo (B=2048)", timeit(lambda: compute_advantages("grpo", inp)), timeit(lambda: ref_grpo(r, g, True), max_reps=3), "python loop")

    # GAE: B=32 x T=256 (the vectorised version scans T in Python, vectorised over B)
    b = random_batch(1, n_groups=8, group_size=4, T=256)
    tok_r = torch.where(b.mask_BT, torch.randn(b.mask_BT.shape, dtype=torch.float64), 0.0)
    tr, vv = tolist2(tok_r), tolist2(b.values_BT)
    row("gae (B=32, T=256)", timeit(lambda: gae_advantages_BT(tok_r, b.values_BT, b.mask_BT, gamma=0.99, lam=0.95)),
        timeit(lambda: ref_gae(tr, vv, b.mask_BT, 0.99, 0.95), max_reps=2), "python loop")

    # PPO-clip + domain_token_mean, forward + backward: B=32 x T=512
    b = random_batch(2, n_groups=8, group_size=4, T=512)
    lp = b.logprobs_BT.clone().requires_grad_(True)

    def ppo_fwd_bwd() -> None:
        loss, _ = compute_policy_loss("ppo_clip", PolicyLossInputs(lp, b.old_logprobs_BT, b.adv_BT, b.mask_BT), PolicyLossParams(),
                                      aggregation="domain_token_mean", domain_ids_B=b.domain_ids_B)
        loss.backward()

    lpl, oll, adl = tolist2(b.logprobs_BT), tolist2(b.old_logprobs_BT), tolist2(b.adv_BT)

    def ppo_ref() -> float:
        per = [[ref_ppo_token(lpl[i][t], oll[i][t], adl[i][t], 0.2, 0.28) if bool(b.mask_BT[i, t]) else 0.0 for t in range(len(lpl[i]))] for i in range(len(lpl))]
        return ref_aggregate(per, b.mask_BT, "domain_token_mean", b.domain_ids_B.tolist())

    row("ppo_clip+domain_token_mean fwd+bwd (32x512)", timeit(ppo_fwd_bwd), timeit(ppo_ref, max_reps=2), "python loop (fwd only)")

    # larger policy-loss call, no reference: cost per token at trainer-like sizes
    B, T = 64, 4096
    lpb = (-torch.rand(B, T)).requires_grad_(True)
    oldb = lpb.detach() + 0.05 * torch.randn(B, T)
    advb = torch.randn(B, 1).expand(B, T)
    maskb = torch.rand(B, T) > 0.3
    dom = torch.arange(B) % 4
    n_tok = int(maskb.sum())
    print(f"-- trainer-like size, no reference: B={B}, T={T}, {n_tok} generated tokens, fp32 --")
    for name in ("ppo_clip", "gspo", "cispo"):
        def f(name: str = name) -> None:
            loss, _ = compute_policy_loss(name, PolicyLossInputs(lpb, oldb, advb, maskb), aggregation="domain_token_mean", domain_ids_B=dom)
            loss.backward()
        tf = timeit(f)
        print(f"{name + ' fwd+bwd (incl. metrics)':<42} {tf * 1e3:>10.3f} ms  {tf / n_tok * 1e9:>8.1f} ns/token")
    tis = timeit(lambda: truncated_is_weights(oldb, oldb + 0.01, maskb, cap=2.0))
    print(f"{'truncated_is_weights (token level)':<42} {tis * 1e3:>10.3f} ms  {tis / n_tok * 1e9:>8.1f} ns/token")
    rew = torch.zeros(B, T)
    gae_t = timeit(lambda: gae_advantages_BT(rew, oldb, maskb, gamma=0.99, lam=0.95))
    print(f"{'gae (B=64, T=4096)':<42} {gae_t * 1e3:>10.3f} ms  {gae_t / n_tok * 1e9:>8.1f} ns/token")

    # router aux: ours vs transformers (same configuration: pooled layers, per-token counts)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    L, N, E, K = 8, 8192, 64, 8
    gate = tuple(torch.randn(N, E) for _ in range(L))
    ids = [torch.topk(torch.softmax(x, -1), K, dim=-1).indices for x in gate]
    ids_LNK = torch.stack(ids)
    logits_LNE = torch.stack(gate)
    ours = timeit(lambda: load_balance_loss(logits_LNE, ids_LNK, count_per="token", layer_reduction="pooled"))
    hf = timeit(lambda: load_balancing_loss_func(gate, E, K, None))
    row(f"router aux (L={L}, N={N}, E={E}, k={K})", ours, hf, "transformers Mixtral")
    a, _ = load_balance_loss(logits_LNE, ids_LNK, count_per="token", layer_reduction="pooled")
    print(f"  router aux values: ours {a.item():.6f}  transformers {load_balancing_loss_func(gate, E, K, None).item():.6f}")


if __name__ == "__main__":
    main()
