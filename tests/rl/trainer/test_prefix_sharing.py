"""`trainer.prefix_sharing` on a real DeepSpeed trainer (gloo, CPU) with a tiny random Mixtral: the packed
trainer computes the same old-policy logprobs, the same R2 routes, the same reference logprobs and the
same gradient as the padded one, on a GRPO batch of groups that share long prompts, and its forwards
compute fewer positions; the PPO critic's values and value loss are the same packed and padded. (The router aux term is left out: packed, it averages over the tree's nodes,
so a shared prompt token counts once, by design.) HybridMoe (linear attention) cannot pack: 'on' refuses it, 'auto' runs it padded.
Runs in a spawned process (torch.distributed is process-global)."""
from __future__ import annotations

import os

import pytest

from tests import REPO
from tests.helpers.spawn import run_spawned

pytestmark = pytest.mark.slow


def _grpo_episodes(vocab: int, seed: int = 0):
    """3 groups x 4 samples: a 60-token prompt per group, generations of 6-16 tokens (two per group
    open with the same 3 tokens), in two domains."""
    import random

    from rl.types import Episode

    rng = random.Random(seed)
    eps = []
    for g in range(3):
        prompt = [rng.randrange(11, vocab) for _ in range(60 + g)]
        opening = [rng.randrange(11, vocab) for _ in range(3)]
        for i in range(4):
            gen = [rng.randrange(11, vocab) for _ in range(rng.randint(6, 16))]
            if i < 2:
                gen[:3] = opening
            ids = tuple(prompt + gen)
            mask = tuple([0] * len(prompt) + [1] * len(gen))
            eps.append(Episode(task_id=f"t{g}", domain=("a", "b")[g % 2], group_id=f"g{g}", token_ids=ids, loss_mask=mask,
                               rollout_logprobs=tuple(-3.0 * m for m in mask), messages=(), reward=float(i % 2)))
    return eps


def _run(tmp: str) -> dict:
    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.algos import aggregation_weights
    from rl.objective import RLObjective
    from rl.trainer.batch import collate
    from rl.trainer.critic import CriticSpec, CriticTrainer
    from rl.trainer.policy import PolicyTrainer, TrainerSpec
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    init = build_tiny_checkpoint(f"{tmp}/mixtral", TinyModelSpec(kind="mixtral", num_experts=4, top_k=2))
    eps = _grpo_episodes(512)
    adv = [1.0, -1.0, 0.5, -0.5] * 3
    batch = collate(eps, adv, domains=("a", "b"))
    w, _ = aggregation_weights("seq_mean_token_mean", batch.loss_mask_BT > 0)
    batch = batch.with_(loss_weights_BT=w)
    mask = batch.loss_mask_BT > 0
    out = {}
    for mode in ("on", "off"):
        tr = PolicyTrainer(init, TrainerSpec(zero_stage=0, lr=1e-3, micro_batch_size=4, routing_replay="r2",
                                             prefix_sharing=mode), RLObjective(router_aux_coef=0.0))
        grads = []
        step = tr.engine.step

        def snapshot_then_step(*a, _step=step, _grads=grads, _tr=tr, **k):  # the accumulated gradient of the update
            _grads.extend(p.grad.detach().clone() for p in _tr.module.parameters() if p.grad is not None)
            return _step(*a, **k)

        tr.engine.step = snapshot_then_step
        tr.load_reference(init)
        old, routes = tr.compute_logprobs(batch)
        ref = tr.reference_logprobs(batch)
        m = tr.train_step(batch.with_(old_logprobs_BT=old, routed_experts_BTLK=routes, routes_from="trainer"))
        after, _ = tr.compute_logprobs(batch)
        # the critic: two value steps toward per-row returns (the zero head makes the first values 0)
        crit = CriticTrainer(init, CriticSpec(zero_stage=0, lr=1e-3, micro_batch_size=4, prefix_sharing=mode))
        returns = torch.as_tensor([float(e.reward) for e in eps])[:, None] * mask
        vloss = []
        for _ in range(2):
            v = crit.values(batch)
            vloss.append(crit.value_step(batch.with_(values_BT=v, returns_BT=returns))["value/loss"])
        out[mode] = {"old": old[mask], "ref": ref[mask], "routes": routes[batch.attention_mask_BT > 0], "after": after[mask],
                     "grads": grads, "metrics": m, "packs": tr._packs[id(tr.module)], "critic_packs": crit.packs,
                     "values": crit.values(batch)[mask], "vloss": vloss}
        del tr, crit
    on, off = out["on"], out["off"]
    res = {
        "packs": (on["packs"], off["packs"]),
        "old": float((on["old"] - off["old"]).abs().max()),
        "ref": float((on["ref"] - off["ref"]).abs().max()),
        "routes_equal": bool(torch.equal(on["routes"], off["routes"])),
        "after": float((on["after"] - off["after"]).abs().max()),
        "moved": float((on["after"] - on["old"]).abs().max()),
        "n_grads": (len(on["grads"]), len(off["grads"])),
        "grad_err": max(float((a - b).abs().max()) for a, b in zip(on["grads"], off["grads"])),
        "grad_max": max(float(b.abs().max()) for b in off["grads"]),
        "loss": (on["metrics"]["loss/total"], off["metrics"]["loss/total"]),
        "fwd_tokens": (on["metrics"]["train/forward_tokens"], off["metrics"]["train/forward_tokens"]),
        "real_tokens": on["metrics"]["train/tokens"],
        "critic_packs": (on["critic_packs"], off["critic_packs"]),
        "values": float((on["values"] - off["values"]).abs().max()),
        "values_max": float(off["values"].abs().max()),
        "vloss": (on["vloss"], off["vloss"]),
    }
    torch.manual_seed(0)
    HybridMoeForCausalLM(load_shipped_config("tiny")).save_pretrained(f"{tmp}/hybrid")
    try:
        PolicyTrainer(f"{tmp}/hybrid", TrainerSpec(prefix_sharing="on"), RLObjective())
        res["hybrid_on"] = "accepted"
    except ValueError as e:
        res["hybrid_on"] = str(e)
    res["hybrid_auto"] = PolicyTrainer(f"{tmp}/hybrid", TrainerSpec(prefix_sharing="auto"), RLObjective())._packs
    res["hybrid_auto"] = list(res["hybrid_auto"].values())
    return res


def test_packed_trainer_equals_padded_trainer(tmp_path):
    res = run_spawned(_run, str(tmp_path))
    assert "error" not in res, res.get("error")
    assert res["packs"] == (True, False)
    assert res["old"] < 1e-4 and res["ref"] < 1e-4, res
    assert res["routes_equal"]
    assert abs(res["loss"][0] - res["loss"][1]) < 1e-5, res["loss"]
    # the same gradient; Adam's first step is ~lr * sign(g), so the weights after it are compared through the
    # gradient, not elementwise (a float-noise gradient of either sign moves a weight by +-lr)
    assert res["n_grads"][0] == res["n_grads"][1] > 0
    assert res["grad_err"] < 1e-4 * res["grad_max"], res
    assert res["moved"] > 1e-3, res
    # 12 rows of ~70 tokens: each group's prompt computed once, not four times
    on, off = res["fwd_tokens"]
    assert off >= res["real_tokens"] and on < 0.5 * off, res["fwd_tokens"]
    assert "trainer.prefix_sharing='on'" in res["hybrid_on"] and "hybrid_moe" in res["hybrid_on"], res["hybrid_on"]
    assert res["hybrid_auto"] == [False]
    assert res["critic_packs"] == (True, False)
    assert res["values_max"] > 1e-3 and res["values"] < 1e-4 * max(1.0, res["values_max"]), res
    (on0, on1), (off0, off1) = res["vloss"]
    assert abs(on0 - off0) < 1e-6 and abs(on1 - off1) < 1e-5 * max(1.0, off1) and on1 < on0, res["vloss"]
