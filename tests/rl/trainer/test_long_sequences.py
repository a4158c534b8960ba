"""The long-sequence knobs of the trainer leave its numbers alone: tiled logprobs (`trainer.logprob_tile_tokens`),
activation checkpointing (`trainer.activation_checkpointing`) and token-budget micro-batches
(`trainer.max_tokens_per_micro_batch`), each alone and all together, against the plain trainer (full logits, no
checkpointing, 4 rows a micro-batch) on a real DeepSpeed engine (gloo, CPU):
- a tiny random Mixtral, shared-prefix packed, R2 routing replay, a KL reference: the same old-policy logprobs,
  recorded routes, reference logprobs and accumulated gradient of one update;
- the tiny HybridMoe with a sparse DSA layer (top-16 keys) and its delta-rule layers, R2 replay: the same, and
  the same expert-load counts (a checkpointed layer re-run in the backward must not count its tokens twice);
- the critic (Mixtral, packed): the same values, value loss and gradient.
Every setting runs on one trainer (the knobs are read on every pass; checkpointing is prepared at start-up),
whose optimizer step is replaced by a gradient snapshot, so all settings see the same weights.
The router load-balance term is left out of the objective: it is a per-micro-batch term, so token-budget
micro-batches change it by design. Runs in a spawned process (torch.distributed is process-global)."""
from __future__ import annotations

import os

import pytest

from tests import REPO
from tests.helpers.spawn import run_spawned

pytestmark = pytest.mark.slow


def _episodes(vocab: int):
    """3 groups x 4 samples, prompts of 40-42 tokens, generations of 6-30 (two per group open alike)."""
    import random

    from rl.types import Episode

    rng = random.Random(0)
    eps = []
    for g in range(3):
        prompt = [rng.randrange(11, vocab) for _ in range(40 + g)]
        opening = [rng.randrange(11, vocab) for _ in range(3)]
        for i in range(4):
            gen = [rng.randrange(11, vocab) for _ in range(rng.randint(6, 30))]
            if i < 2:
                gen[:3] = opening
            mask = tuple([0] * len(prompt) + [1] * len(gen))
            eps.append(Episode(task_id=f"t{g}", domain=("a", "b")[g % 2], group_id=f"g{g}", token_ids=tuple(prompt + gen),
                               loss_mask=mask, rollout_logprobs=tuple(-3.0 * m for m in mask), messages=(), reward=float(i % 2)))
    return eps


SETTINGS = {  # name -> the TrainerSpec / CriticSpec fields it changes
    "plain": dict(logprob_tile_tokens=0, activation_checkpointing="off"),
    "tiled": dict(logprob_tile_tokens=16, activation_checkpointing="off"),
    "checkpointed": dict(logprob_tile_tokens=0, activation_checkpointing="on"),
    "token_budget": dict(logprob_tile_tokens=0, activation_checkpointing="off", max_tokens_per_micro_batch=150),
    "all": dict(logprob_tile_tokens=16, activation_checkpointing="on", max_tokens_per_micro_batch=150),
}


def _snapshot_steps(engine, module, into: dict) -> None:
    """Make `engine.step()` record the accumulated gradient (and HybridMoe's expert-load counts) and drop it
    instead of updating: every setting then runs on the same weights in one trainer (one engine start-up)."""
    def step(*a, **k):
        into["grads"] = [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]
        if hasattr(module, "accumulated_expert_load"):
            into["load"] = module.accumulated_expert_load().clone()
        engine.zero_grad()

    engine.step = step


def _policy_runs(init: str, batch) -> dict:
    """Each setting on one trainer built with checkpointing prepared ('on'); a setting is its spec, which
    the trainer reads on every pass (tile size, checkpointing mode, micro-batching)."""
    from dataclasses import replace

    from rl.objective import RLObjective
    from rl.trainer.batch import micro_rows
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    spec = TrainerSpec(zero_stage=0, lr=1e-3, micro_batch_size=4, routing_replay="r2", activation_checkpointing="on")
    tr = PolicyTrainer(init, spec, RLObjective(router_aux_coef=0.0, kl_coef=0.1))
    tr.load_reference(init)
    mask = batch.loss_mask_BT > 0
    runs = {}
    for name, fields in SETTINGS.items():
        tr.spec = replace(spec, **fields)
        snap: dict = {}
        _snapshot_steps(tr.engine, tr.module, snap)
        old, routes = tr.compute_logprobs(batch)
        ref = tr.reference_logprobs(batch)
        b = batch.with_(old_logprobs_BT=old, ref_logprobs_BT=ref, routed_experts_BTLK=routes, routes_from="trainer")
        m = tr.train_step(b)
        runs[name] = {"old": old[mask], "ref": ref[mask], "routes": routes[batch.attention_mask_BT > 0],
                      "micro_batches": len(micro_rows(batch, tr.spec.micro)),
                      "metrics": (m["train/tokens_per_s"], m["train/peak_rss_gb"]), **snap}
    return runs


def _critic_runs(init: str, batch) -> dict:
    from dataclasses import replace

    from rl.trainer.critic import CriticSpec, CriticTrainer

    spec = CriticSpec(zero_stage=0, lr=1e-3, micro_batch_size=4, activation_checkpointing="on")
    crit = CriticTrainer(init, spec)
    with_head = []
    for p in crit.engine.module.head.parameters():  # a non-zero head, so the trunk gets a gradient too
        p.data.normal_(0.0, 0.1)
        with_head.append(p)
    mask = batch.loss_mask_BT > 0
    returns = batch.rewards_B[:, None] * mask
    runs = {}
    for name, fields in SETTINGS.items():
        crit.spec = replace(spec, **{k: v for k, v in fields.items() if k != "logprob_tile_tokens"})
        snap: dict = {}
        _snapshot_steps(crit.engine, crit.engine.module, snap)
        v = crit.values(batch)
        m = crit.value_step(batch.with_(values_BT=v * 0.5, returns_BT=returns))
        runs[name] = {"values": v[mask], "vloss": m["value/loss"], **snap}
    return runs


def _diff(a, b) -> float:
    return float((a - b).abs().max())


def _compare(runs: dict) -> dict:
    import torch

    base = runs["plain"]
    res = {}
    for name, r in runs.items():
        res[name] = {
            "n_grads": (len(r["grads"]), len(base["grads"])),
            "grad_err": max(_diff(a, b) for a, b in zip(r["grads"], base["grads"])),
            "grad_max": max(float(b.abs().max()) for b in base["grads"]),
            "micro_batches": r.get("micro_batches"),
            "metrics": r.get("metrics"),
        }
        if "old" in r:
            res[name].update(old=_diff(r["old"], base["old"]), ref=_diff(r["ref"], base["ref"]),
                             routes_equal=bool(torch.equal(r["routes"], base["routes"])))
        if "load" in base:
            res[name].update(load_equal=bool(torch.equal(r["load"], base["load"])), load_sum=float(base["load"].sum()))
        if "values" in r:
            res[name].update(values=_diff(r["values"], base["values"]), values_max=float(base["values"].abs().max()),
                             vloss=abs(r["vloss"] - base["vloss"]))
    return res


def _run(tmp: str) -> dict:
    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    mixtral = str(build_tiny_checkpoint(f"{tmp}/mixtral", TinyModelSpec(kind="mixtral", num_experts=4, top_k=2)))
    torch.manual_seed(0)
    cfg = load_shipped_config("tiny")
    cfg.index_topk = 16  # sparse DSA on these ~60-token rows
    HybridMoeForCausalLM(cfg).save_pretrained(f"{tmp}/hybrid")
    out = {}
    for name, init, vocab in (("mixtral", mixtral, 512), ("hybrid", f"{tmp}/hybrid", 8192)):
        batch = collate(_episodes(vocab), [1.0, -1.0, 0.5, -0.5] * 3, domains=("a", "b"))
        w, _ = aggregation_weights("seq_mean_token_mean", batch.loss_mask_BT > 0)
        batch = batch.with_(loss_weights_BT=w)
        out[name] = _compare(_policy_runs(init, batch))
        if name == "mixtral":
            out["critic"] = _compare(_critic_runs(init, batch))
    return out


def test_long_sequence_knobs_leave_logprobs_routes_and_update_unchanged(tmp_path):
    res = run_spawned(_run, str(tmp_path))
    assert "error" not in res, res.get("error")
    for model in ("mixtral", "hybrid", "critic"):
        for name, r in res[model].items():
            where = (model, name, r)
            assert r["n_grads"][0] == r["n_grads"][1] > 0, where
            assert r["grad_err"] < 1e-4 * r["grad_max"], where
            if model != "critic":
                tokens_per_s, peak_gb = r["metrics"]
                assert tokens_per_s > 0 and 0.1 < peak_gb < 64, where
                assert r["old"] < 1e-5 and r["ref"] < 1e-5, where
                assert r["routes_equal"], where
            if model == "hybrid":  # a checkpointed layer's recompute does not count its tokens' expert load again
                assert r["load_equal"] and r["load_sum"] > 0, where
            if model == "critic":
                assert r["values_max"] > 1e-3 and r["values"] < 1e-5 * max(1.0, r["values_max"]), where
                assert r["vloss"] < 1e-6, where
    for model in ("mixtral", "hybrid"):
        # the budget of 150 padded tokens cuts the 12 rows of 46-72 tokens into 2-row micro-batches, not 3 of 4
        assert res[model]["plain"]["micro_batches"] == 3
        assert res[model]["token_budget"]["micro_batches"] == res[model]["all"]["micro_batches"] == 6, res[model]
