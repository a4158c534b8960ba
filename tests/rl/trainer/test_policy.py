"""PolicyTrainer on a real DeepSpeed engine (gloo, CPU) with the tiny HybridMoe and the RL objective.

Runs in a spawned process: torch.distributed is process-global and must not leak into other tests
(vLLM engines in the same pytest process initialise their own groups).
"""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def _episodes(n: int, T: int, vocab: int, seed: int):
    import random

    from rl.types import Episode

    rng = random.Random(seed)
    eps = []
    for i in range(n):
        L = T - rng.randint(0, 8)
        ids = tuple(rng.randrange(11, vocab) for _ in range(L))
        mask = tuple([0] * 10 + [1] * (L - 10))
        eps.append(Episode(task_id=f"t{i // 2}", domain=("a", "b")[i % 2], group_id=f"g{i // 2}", token_ids=ids, loss_mask=mask,
                           rollout_logprobs=tuple(-3.0 * m for m in mask), messages=(), reward=float(i % 2)))
    return eps


def _weighted_batch(n: int, T: int, vocab: int, seed: int):
    """`n` episodes (advantages +1/-1 alternating over two domains), collated with domain-token-mean loss weights."""
    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate

    batch = collate(_episodes(n, T, vocab, seed), [1.0, -1.0] * (n // 2), domains=("a", "b"))
    w, _ = aggregation_weights("domain_token_mean", batch.loss_mask_BT > 0, domain_ids_B=batch.domain_ids_B)
    return batch.with_(loss_weights_BT=w)


def _run(tmp: str, zero_stage: int) -> dict:
    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.objective import RLObjective
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.manual_seed(0)
    cfg = load_shipped_config("tiny")
    HybridMoeForCausalLM(cfg).save_pretrained(f"{tmp}/init")
    tr = PolicyTrainer(f"{tmp}/init", TrainerSpec(zero_stage=zero_stage, lr=1e-3, micro_batch_size=2, routing_replay="auto"),
                       RLObjective(router_aux_coef=0.01))
    batch = _weighted_batch(6, 48, cfg.vocab_size, 0)
    before = {n: t.clone() for n, t in tr.named_weights()}
    old_lp, routes = tr.compute_logprobs(batch)
    # R2: recorded routes replayed reproduce the forward exactly
    lp_replay, _ = tr.compute_logprobs(batch.with_(routed_experts_BTLK=routes, routes_from="engine"))
    b2 = batch.with_(old_logprobs_BT=old_lp, routed_experts_BTLK=routes, routes_from="trainer")
    m = tr.train_step(b2)
    after = dict(tr.named_weights())
    changed = sum(int(not torch.equal(before[n], after[n])) for n in before)
    router_changed = any(not torch.equal(before[n], after[n]) for n in before if "router" in n or "gate.weight" in n)
    # checkpoint round trip
    tr.save_checkpoint(f"{tmp}/ckpt")
    lp_saved, _ = tr.compute_logprobs(batch)
    tr.train_step(b2)
    lp_moved, _ = tr.compute_logprobs(batch)
    tr.load_checkpoint(f"{tmp}/ckpt")
    lp_loaded, _ = tr.compute_logprobs(batch)
    mask = batch.loss_mask_BT > 0
    return {
        "routes_shape": tuple(routes.shape),
        "replay_max_diff": float((old_lp - lp_replay)[mask].abs().max()),
        "changed": changed, "n": len(before), "router_changed": router_changed,
        "loss_finite": bool(torch.isfinite(torch.tensor(m["loss/total"]))),
        "replay_mode": [k for k in m if k.startswith("train/routing_replay_")],
        "has_router_metrics": "router/loss" in m, "grad_norm": m["train/grad_norm"],
        "moved": float((lp_moved - lp_saved)[mask].abs().max()), "restored": float((lp_loaded - lp_saved)[mask].abs().max()),
    }


@pytest.mark.parametrize("zero_stage", [1])
def test_rl_step_with_replay_and_checkpoint(tmp_path, zero_stage):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        r = pool.apply(_run, (str(tmp_path), zero_stage))
    assert r["routes_shape"][0] == 6 and r["routes_shape"][-1] == 2  # [B, T, L, k]
    assert r["replay_max_diff"] < 1e-5
    assert r["changed"] > r["n"] // 2 and r["router_changed"]  # the router learns under replay
    assert r["loss_finite"] and r["has_router_metrics"] and r["grad_norm"] > 0
    assert r["replay_mode"] == ["train/routing_replay_r2"]
    assert r["moved"] > 1e-4  # the extra step changed the policy...
    assert r["restored"] < 1e-6  # ...and loading the checkpoint restored it exactly


def _frozen(tmp: str) -> dict:
    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.objective import RLObjective
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.manual_seed(0)
    cfg = load_shipped_config("tiny")
    HybridMoeForCausalLM(cfg).save_pretrained(f"{tmp}/init")
    try:
        PolicyTrainer(f"{tmp}/init", TrainerSpec(lr=1e-3, micro_batch_size=2, frozen_layers=cfg.num_hidden_layers + 1))
        too_many = ""
    except ValueError as e:
        too_many = str(e)
    tr = PolicyTrainer(f"{tmp}/init", TrainerSpec(lr=1e-3, micro_batch_size=2, frozen_layers=2), RLObjective(router_aux_coef=0.01))
    batch = _weighted_batch(4, 40, cfg.vocab_size, 1)
    before = {n: t.clone() for n, t in tr.named_weights()}
    old_lp, routes = tr.compute_logprobs(batch)
    tr.train_step(batch.with_(old_logprobs_BT=old_lp, routed_experts_BTLK=routes, routes_from="trainer"))
    after = dict(tr.named_weights())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    frozen_numel = sum(p.numel() for n, p in tr.module.named_parameters() if not p.requires_grad)
    return {"changed": sorted(changed), "names": sorted(before), "frozen_params": tr.frozen_params, "frozen_numel": frozen_numel,
            "too_many": too_many, "layers": cfg.num_hidden_layers}


def test_frozen_layers_keep_the_embeddings_and_bottom_layers_and_train_the_rest(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        r = pool.apply(_frozen, (str(tmp_path),))
    assert f"trainer.frozen_layers={r['layers'] + 1}" in r["too_many"]

    def layer(n: str) -> int | None:
        parts = n.split(".")
        return int(parts[parts.index("layers") + 1]) if "layers" in parts else None

    bottom = [n for n in r["names"] if layer(n) in (0, 1) or "embed_tokens" in n]
    top = [n for n in r["names"] if layer(n) is not None and layer(n) >= 2]
    assert bottom and top
    assert not set(bottom) & set(r["changed"])          # nothing frozen moved
    assert len(set(top) & set(r["changed"])) > len(top) // 2  # the upper layers trained
    assert r["frozen_params"] == r["frozen_numel"] > 0


def _one_rank_step(tmp: str, zero_stage) -> dict:
    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.objective import RLObjective
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.manual_seed(0)
    cfg = load_shipped_config("tiny")
    HybridMoeForCausalLM(cfg).save_pretrained(f"{tmp}/init")
    tr = PolicyTrainer(f"{tmp}/init", TrainerSpec(zero_stage=zero_stage, lr=1e-3, micro_batch_size=2, grad_clip=1e-3,
                                                  routing_replay="off"), RLObjective(router_aux_coef=0.01))
    batch = _weighted_batch(4, 40, cfg.vocab_size, 2)
    old_lp, _ = tr.compute_logprobs(batch)
    m = {}
    for _ in range(2):  # the second step uses the Adam moments of the first
        m = tr.train_step(batch.with_(old_logprobs_BT=old_lp))
    return {"stage": tr.engine.zero_optimization_stage(), "grad_norm": m["train/grad_norm"],
            "weights": {n: t.clone() for n, t in tr.named_weights()}}


def test_auto_zero_stage_on_one_rank_is_stage_0_with_the_update_of_zero_1(tmp_path):
    """`trainer.zero_stage: auto` runs ZeRO-0 on one rank (ZeRO-1 would shard nothing and only add buffers) and
    computes the same two clipped AdamW steps as ZeRO-1."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        zero1 = pool.apply(_one_rank_step, (str(tmp_path / "z1"), 1))
    with ctx.Pool(1) as pool:
        auto = pool.apply(_one_rank_step, (str(tmp_path / "auto"), "auto"))
    assert zero1["stage"] == 1 and auto["stage"] == 0
    assert zero1["grad_norm"] > 1e-3  # the clip (1e-3) is active, so both stages clip the same way
    assert abs(zero1["grad_norm"] - auto["grad_norm"]) <= 1e-5 * zero1["grad_norm"]
    assert zero1["weights"].keys() == auto["weights"].keys()
    worst = max(float((zero1["weights"][n] - auto["weights"][n]).abs().max()) for n in zero1["weights"])
    assert worst <= 1e-6, f"ZeRO-1 and auto (ZeRO-0) differ by {worst:.3g}"


def _save_or_resume(tmp: str, zero_stage, save: bool) -> str:
    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.objective import RLObjective
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.manual_seed(0)
    cfg = load_shipped_config("tiny")
    if save:
        HybridMoeForCausalLM(cfg).save_pretrained(f"{tmp}/init")
    tr = PolicyTrainer(f"{tmp}/init", TrainerSpec(zero_stage=zero_stage, lr=1e-3, micro_batch_size=2, routing_replay="off"),
                       RLObjective())
    if save:
        tr.save_checkpoint(f"{tmp}/ckpt")
        return "saved"
    try:
        tr.load_checkpoint(f"{tmp}/ckpt")
    except ValueError as e:
        return str(e)
    return "resumed"


def test_a_zero_1_checkpoint_resumed_under_zero_0_is_refused_naming_the_key(tmp_path):
    """DeepSpeed keeps ZeRO-0's and ZeRO-1's optimizer state in different files; resuming across them names the key."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(_save_or_resume, (str(tmp_path), 1, True)) == "saved"
    with ctx.Pool(1) as pool:
        refused = pool.apply(_save_or_resume, (str(tmp_path), "auto", False))
    with ctx.Pool(1) as pool:
        resumed = pool.apply(_save_or_resume, (str(tmp_path), 1, False))
    assert "config key 'trainer.zero_stage'" in refused and "ZeRO-0" in refused and "1, 2 or 3" in refused, refused
    assert resumed == "resumed"
