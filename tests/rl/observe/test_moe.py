"""rl/observe/moe.py against slow per-token loops written from the formulas, transformers' Mixtral
load-balancing loss, rl/algos/router.py, and a real HybridMoe forward (the trainer's exact inputs)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from tests.rl.observe.dash_moe_cases import DOMS, all_reduce_worker, random_case
from rl.algos.router import load_balance_loss, router_z_loss
from rl.observe.moe import (
    expert_load_DLE,
    fresh_routes,
    MoeStepTelemetry,
    moe_batch_stats,
    moe_metrics,
    router_biases,
    moe_telemetry,
    stats_from_forward,
    token_domain_ids,
)



def ref_metrics(routes, dom, mask, logits, fresh, E, domains, scoring="softmax"):
    """Per-token Python loops: the obvious reading of the module docstring's formulas."""
    L, N, K = routes.shape
    out = {}
    groups = {d: [n for n in range(N) if mask[n] and dom[n] == i] for i, d in enumerate(domains)}
    groups["all"] = [n for n in range(N) if mask[n]]
    for name, toks in groups.items():
        n = len(toks)
        if n == 0:
            continue
        vio, aux, ent, z, slots, tmis = [], [], 0.0, 0.0, 0, 0
        load_LE = [[0.0] * E for _ in range(L)]
        for l in range(L):
            count = [0] * E
            psum = [0.0] * E
            for t in toks:
                for k in range(K):
                    count[int(routes[l, t, k])] += 1
                if logits is not None:
                    row = [float(v) for v in logits[l, t]]
                    if scoring == "softmax":
                        mx = max(row)
                        ex = [math.exp(v - mx) for v in row]
                        p = [v / sum(ex) for v in ex]
                    else:
                        sg = [1 / (1 + math.exp(-v)) for v in row]
                        p = [v / sum(sg) for v in sg]
                    for e in range(E):
                        psum[e] += p[e]
                    ent += -sum(pe * math.log(pe) for pe in p if pe > 0)
                    mx = max(row)
                    z += (mx + math.log(sum(math.exp(v - mx) for v in row))) ** 2
                if fresh is not None:
                    a = {int(x) for x in routes[l, t]}
                    b = {int(x) for x in fresh[l, t]}
                    slots += K - len(a & b)
                    tmis += a != b
            loads = [E * c / (K * n) for c in count]
            load_LE[l] = loads
            mean_load = sum(loads) / E
            vio.append((max(loads) - mean_load) / mean_load)
            aux.append(E * sum((count[e] / (n * K)) * (psum[e] / n) for e in range(E)))
        out[f"moe/tokens/{name}"] = n
        out[f"moe/max_vio/{name}"] = sum(vio) / L
        out[f"moe/max_vio_worst/{name}"] = max(vio)
        for l in range(L):
            out[f"moe/max_vio_l{l:02d}/{name}"] = vio[l]
        for e in range(E):
            out[f"moe/load_e{e:03d}/{name}"] = sum(load_LE[l][e] for l in range(L)) / L
        if logits is not None:
            out[f"moe/router_entropy/{name}"] = ent / (n * L)
            out[f"moe/router_entropy_norm/{name}"] = ent / (n * L) / math.log(E)
            out[f"moe/aux_loss/{name}"] = sum(aux) / L
            out[f"moe/z_loss/{name}"] = z / (n * L)
        if fresh is not None:
            out[f"moe/replay_mismatch/{name}"] = slots / (n * L * K)
            out[f"moe/replay_token_mismatch/{name}"] = tmis / (n * L)
    # I(expert; domain) per layer from joint assignment counts
    mis = []
    for l in range(L):
        joint = {}
        for i, d in enumerate(domains):
            for t in groups[d]:
                for k in range(K):
                    joint[(i, int(routes[l, t, k]))] = joint.get((i, int(routes[l, t, k])), 0) + 1
        tot = sum(joint.values())
        if tot == 0:
            continue
        pd = {i: sum(v for (a, _), v in joint.items() if a == i) / tot for i in range(len(domains))}
        pe = {e: sum(v for (_, b), v in joint.items() if b == e) / tot for e in range(E)}
        mis.append(sum(v / tot * math.log((v / tot) / (pd[a] * pe[b])) for (a, b), v in joint.items()))
    out["moe/expert_domain_mi/all"] = sum(mis) / len(mis) if mis else 0.0
    return out


def assert_metrics_close(got, want, tol=1e-9):
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=tol, rel=1e-9), k


@pytest.mark.parametrize("seed,skip", [(0, None), (1, None), (2, 1)])
def test_metrics_match_slow_reference(seed, skip):
    routes, dom, mask, logits, fresh = random_case(seed, skip_domain=skip)
    got = moe_telemetry(routes, dom, DOMS, 6, token_mask_N=mask, router_logits=logits, fresh_routes_LNK=fresh)
    want = ref_metrics(routes, dom.tolist(), mask.tolist(), logits, fresh, 6, DOMS)
    assert_metrics_close(got, want)
    if skip is not None:  # a domain with no tokens is left out, not NaN
        assert f"moe/tokens/{DOMS[skip]}" not in got


def test_sigmoid_scoring_matches_reference():
    routes, dom, mask, logits, _ = random_case(3)
    got = moe_telemetry(routes, dom, DOMS, 6, token_mask_N=mask, router_logits=logits, scoring="sigmoid")
    assert_metrics_close(got, ref_metrics(routes, dom.tolist(), mask.tolist(), logits, None, 6, DOMS, scoring="sigmoid"))


def test_routes_only_gives_load_metrics_without_logit_metrics():
    routes, dom, mask, _, _ = random_case(4)
    got = moe_telemetry(routes, dom, DOMS, 6, token_mask_N=mask, per_layer=False)
    assert_metrics_close(got, {k: v for k, v in ref_metrics(routes, dom.tolist(), mask.tolist(), None, None, 6, DOMS).items()
                               if "max_vio_l" not in k})
    assert not any("entropy" in k or "aux" in k or "replay" in k for k in got)


def test_micro_batches_add_up_to_the_whole_batch():
    routes, dom, mask, logits, fresh = random_case(5, N=60)
    whole = moe_batch_stats(routes, dom, DOMS, 6, token_mask_N=mask, router_logits=logits, fresh_routes_LNK=fresh)
    parts = [moe_batch_stats(routes[:, s], dom[s], DOMS, 6, token_mask_N=mask[s], router_logits=logits[:, s], fresh_routes_LNK=fresh[:, s])
             for s in (slice(0, 17), slice(17, 40), slice(40, 60))]
    assert_metrics_close(moe_metrics(parts[0] + parts[1] + parts[2]), moe_metrics(whole))


def test_adding_incompatible_stats_is_refused():
    routes, dom, mask, logits, _ = random_case(6)
    a = moe_batch_stats(routes, dom, DOMS, 6, token_mask_N=mask, router_logits=logits)
    b = moe_batch_stats(routes, dom, DOMS, 6, token_mask_N=mask)
    with pytest.raises(ValueError, match="router logits"):
        _ = a + b
    c = moe_batch_stats(routes, dom, ("x", "y", "z"), 6, token_mask_N=mask, router_logits=logits)
    with pytest.raises(ValueError, match="domains"):
        _ = a + c


def test_hand_computed_load_violation_and_mutual_information():
    # 2 domains, 4 tokens each, E=4, K=2, one layer. Domain 0 always uses {0,1}; domain 1 always {2,3}.
    routes = torch.tensor([[[0, 1]] * 4 + [[2, 3]] * 4])
    dom = torch.tensor([0] * 4 + [1] * 4)
    m = moe_telemetry(routes, dom, ("x", "y"), 4)
    assert m["moe/load_e000/x"] == 2.0 and m["moe/load_e002/x"] == 0.0  # half of x's slots each on 2 of 4 experts
    assert m["moe/max_vio/x"] == 1.0 and m["moe/max_vio/all"] == 0.0  # each domain skewed, together balanced
    assert m["moe/expert_domain_mi/all"] == pytest.approx(math.log(2))  # expert choice reveals the domain
    M = expert_load_DLE(moe_batch_stats(routes, dom, ("x", "y"), 4)).mean(axis=1)  # [D, E], layers averaged
    np.testing.assert_allclose(M, [[2, 2, 0, 0], [0, 0, 2, 2]])
    # Same routes for both domains: no affinity.
    m2 = moe_telemetry(torch.tensor([[[0, 1], [2, 3]] * 4]), dom, ("x", "y"), 4)
    assert m2["moe/expert_domain_mi/all"] == pytest.approx(0.0, abs=1e-12)


def test_replay_mismatch_hand_case():
    replayed = torch.tensor([[[0, 1], [2, 3], [0, 1]]])
    fresh = torch.tensor([[[1, 0], [2, 0], [3, 2]]])  # same set (order differs) / one slot / both slots
    m = moe_telemetry(replayed, torch.zeros(3, dtype=torch.long), ("x",), 4, fresh_routes_LNK=fresh)
    assert m["moe/replay_mismatch/x"] == pytest.approx((0 + 1 + 2) / 6)
    assert m["moe/replay_token_mismatch/x"] == pytest.approx(2 / 3)


def test_aux_matches_transformers_mixtral_and_rl_algos():
    """Single layer, no padding: HF's Mixtral loss counts per token (sum f = top_k), ours per assignment,
    so HF = K * ours; rl/algos/router.py (the loss the trainer optimises) must agree exactly."""
    g = torch.Generator().manual_seed(7)
    N, E, K = 50, 8, 2
    logits = torch.randn(N, E, generator=g)
    routes = logits.topk(K, -1).indices
    dom = torch.zeros(N, dtype=torch.long)
    m = moe_telemetry(routes[None], dom, ("x",), E, router_logits=logits[None])
    hf = float(load_balancing_loss_func((logits,), E, K))
    assert K * m["moe/aux_loss/all"] == pytest.approx(hf, rel=1e-5)
    # several layers with padding vs rl/algos/router.py
    routes3, dom3, mask3, logits3, _ = random_case(8)
    m3 = moe_telemetry(routes3, dom3, DOMS, 6, token_mask_N=mask3, router_logits=logits3)
    aux, _ = load_balance_loss(logits3, routes3.clamp_min(0), mask3)
    z, _ = router_z_loss(logits3, mask3)
    assert m3["moe/aux_loss/all"] == pytest.approx(float(aux), rel=1e-9)
    assert m3["moe/z_loss/all"] == pytest.approx(float(z), rel=1e-9)


def test_fresh_routes_match_the_models_own_routing():
    from model.moe import route

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 30, 8, generator=g)
    bias = torch.randn(2, 8, generator=g) * 0.1
    for scoring in ("softmax", "sigmoid"):
        got = fresh_routes(logits, 2, scoring=scoring, bias_LE=bias)
        for l in range(2):
            _, idx, _ = route(logits[l], 2, scoring, True, bias[l])
            assert torch.equal(got[l].sort(-1).values, idx.sort(-1).values)


def test_real_model_forward_inputs():
    """The trainer's exact inputs from a real tiny HybridMoe forward with padding: counts and probability
    sums reproduce the model's own pooled aux loss and z-loss; without replay the model's routes are the
    router's own choice (mismatch 0); replaying other routes gives the reference mismatch."""
    import model  # noqa: F401
    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.trainer.batch import TrainBatch

    torch.manual_seed(0)
    cfg = load_shipped_config("tiny", num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], vocab_size=512)
    m = HybridMoeForCausalLM(cfg).eval()
    B, T = 3, 10
    ids = torch.randint(5, 500, (B, T))
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 7:] = 0
    attn[2, 4:] = 0
    dom_B = torch.tensor([0, 2, 0])
    batch = TrainBatch(input_ids_BT=ids, attention_mask_BT=attn, loss_mask_BT=attn.float(), rollout_logprobs_BT=torch.zeros(B, T),
                       advantages_BT=torch.zeros(B, T), group_ids_B=torch.arange(B), domain_ids_B=dom_B, domains=DOMS,
                       rewards_B=torch.zeros(B))
    with torch.no_grad():
        out = m(input_ids=ids, attention_mask=attn, output_router_logits=True)
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    bias = router_biases(m)
    assert bias is not None and bias.shape == (cfg.num_hidden_layers, E)
    with torch.no_grad():  # non-zero biases, so the check covers the bias-shifted selection
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(E) * 0.05)
        out = m(input_ids=ids, attention_mask=attn, output_router_logits=True)
    bias = router_biases(m)
    fresh = fresh_routes(out.router_logits, K, scoring=cfg.scoring_func, bias_LE=bias)
    st = stats_from_forward(batch, out.routed_experts, E, router_logits=out.router_logits, fresh_routes_LNK=fresh)
    n, L = st.tokens_D.sum(), st.num_layers
    assert n == int(attn.sum()) and st.tokens_D[1] == 0
    pooled_aux = E * float(((st.counts_DLE.sum((0, 1)) / (n * L)) * (st.prob_sum_DLE.sum((0, 1)) / (n * L))).sum())
    assert pooled_aux == pytest.approx(float(out.aux_loss), rel=1e-5)
    met = moe_metrics(st)
    assert met["moe/z_loss/all"] == pytest.approx(float(out.z_loss), rel=1e-5)
    assert met["moe/replay_mismatch/all"] == 0.0
    other = (out.routed_experts + 1) % E  # replay shifted routes
    with torch.no_grad():
        out2 = m(input_ids=ids, attention_mask=attn, output_router_logits=True, routed_experts=other)
    assert torch.equal(out2.routed_experts, other)
    st2 = stats_from_forward(batch, out2.routed_experts, E, router_logits=out2.router_logits,
                             fresh_routes_LNK=fresh_routes(out2.router_logits, K, scoring=cfg.scoring_func, bias_LE=bias))
    mask_N = (attn.reshape(-1) > 0).tolist()
    want = ref_metrics(out2.routed_experts, token_domain_ids(dom_B, T).tolist(), mask_N, torch.stack(out2.router_logits),
                       fresh_routes(out2.router_logits, K, scoring=cfg.scoring_func, bias_LE=bias), E, DOMS, scoring=cfg.scoring_func)
    assert_metrics_close(moe_metrics(st2), want, tol=1e-6)
    assert moe_metrics(st2)["moe/replay_mismatch/all"] > 0
    # the trainer-side accumulator over two micro-batches gives the same step metrics
    acc = MoeStepTelemetry(E, scoring=cfg.scoring_func, bias_LE=bias)
    for rows in (slice(0, 2), slice(2, 3)):
        mb = batch.select(rows)
        with torch.no_grad():
            o = m(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT, output_router_logits=True,
                  routed_experts=other.reshape(len(other), B, T, -1)[:, rows].reshape(len(other), -1, other.shape[-1]))
        acc.add(mb, o.routed_experts, o.router_logits, replayed=True)
    assert_metrics_close(acc.finish(), want, tol=1e-5)
    assert acc.finish() == {}


@pytest.mark.parametrize("kw,msg", [
    (dict(routes_LNK=torch.tensor([[[0, 9]]])), "routes_LNK out of range"),
    (dict(domain_ids_N=torch.tensor([5])), "domain_ids_N out of range"),
    (dict(domain_ids_N=torch.tensor([0, 0])), r"domain_ids_N must be \[N=1\]"),
    (dict(routes_LNK=torch.tensor([[0, 1]])), r"routes_LNK must be a \[L, N, K\]"),
    (dict(routes_LNK=torch.tensor([[[0.0, 1.0]]])), "integer expert ids"),
    (dict(router_logits=torch.zeros(1, 1, 3)), r"router_logits has shape"),
    (dict(fresh_routes_LNK=torch.zeros(1, 1, 3, dtype=torch.long)), "fresh_routes_LNK has shape"),
    (dict(domains=()), "domains"),
    (dict(scoring="relu", router_logits=torch.zeros(1, 1, 4)), "scoring"),
])
def test_bad_inputs_name_the_problem(kw, msg):
    args = dict(routes_LNK=torch.tensor([[[0, 1]]]), domain_ids_N=torch.tensor([0]), domains=("x",), num_experts=4)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=msg):
        moe_batch_stats(**args)


def test_padding_may_carry_garbage():
    routes = torch.tensor([[[0, 1], [-1, 99]]])
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [float("nan")] * 4]])
    m = moe_telemetry(routes, torch.tensor([0, 7]), ("x",), 4, token_mask_N=torch.tensor([True, False]), router_logits=logits)
    assert m["moe/tokens/x"] == 1 and math.isfinite(m["moe/router_entropy/x"]) and math.isfinite(m["moe/z_loss/x"])


@pytest.mark.slow  # spawns two torch processes: ~10-20 s on a busy 2-core machine
def test_all_reduce_over_two_ranks_equals_single_process():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=all_reduce_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    routes, dom, mask, logits, _ = random_case(11, N=40)
    want = moe_telemetry(routes, dom, DOMS, 6, token_mask_N=mask, router_logits=logits)
    assert_metrics_close(res[0], want)
    assert_metrics_close(res[1], want)
