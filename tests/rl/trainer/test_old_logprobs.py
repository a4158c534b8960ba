"""pi_old's logprobs come from the update's own forward: `TrainerWorker.rl_step` (no pass of their own)
makes the same update as a separate no-grad old-logprob pass (with R2 routes recorded) followed by
the step, on a real DeepSpeed trainer (gloo, CPU, tiny HybridMoe). Runs in a spawned process.
"""
from __future__ import annotations

import multiprocessing as mp

import pytest

from tests import REPO
from tests.rl.trainer.test_policy import _episodes

pytestmark = pytest.mark.slow


def _run(tmp: str) -> dict:
    import os

    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.shipped import build_random_checkpoint, load_shipped_config
    from rl.algos import aggregation_weights
    from rl.objective import RLObjective
    from rl.trainer.actor import TrainerWorker
    from rl.trainer.batch import collate
    from rl.trainer.policy import TrainerSpec

    init = build_random_checkpoint("tiny", f"{tmp}/init", seed=0)
    cfg = load_shipped_config("tiny")
    eps = _episodes(6, 40, cfg.vocab_size, 0)
    batch = collate(eps, [1.0, -1.0, 0.5, -0.5, 2.0, -2.0], domains=("a", "b"))
    w, _ = aggregation_weights("token_mean", batch.loss_mask_BT > 0)
    batch = batch.with_(loss_weights_BT=w)
    spec = TrainerSpec(lr=3e-3, micro_batch_size=3)
    obj = RLObjective(tis_cap=2.0)
    fused = TrainerWorker(str(init), spec, obj)
    p_init = [p.detach().clone() for p in fused.t.module.parameters()]
    m_fused = fused.rl_step(batch)
    p_fused = [p.detach().clone() for p in fused.t.module.parameters()]
    del fused
    split = TrainerWorker(str(init), spec, obj)
    old_lp, routes = split.t.compute_logprobs(batch)
    m_split = split.t.train_step(batch.with_(old_logprobs_BT=old_lp, routed_experts_BTLK=routes, routes_from="trainer"))
    p_split = [p.detach().clone() for p in split.t.module.parameters()]
    return {
        "mode": [k for k in m_fused if k.startswith("train/routing_replay_")],
        "routes": None if routes is None else tuple(routes.shape),
        "param_diff": max(float((a - b).abs().max()) for a, b in zip(p_fused, p_split)),
        "param_moved": max(float((a - b).abs().max()) for a, b in zip(p_fused, p_init)),
        "old_s": m_fused["train/old_logprob_s"],
        "fused": {k: m_fused[k] for k in m_split if k.startswith(("mismatch/", "loss/", "offpolicy/"))},
        "split": {k: m_split[k] for k in m_split if k.startswith(("mismatch/", "loss/", "offpolicy/"))},
        "gap_keys": sorted(k for k in m_fused if k.startswith("mismatch/logprob_abs_mean")),
    }


def test_update_forward_supplies_pi_old(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        r = pool.apply(_run, (str(tmp_path),))
    print(r)
    assert r["mode"] == ["train/routing_replay_r2"] and r["routes"] is not None  # the split path really replays R2 routes
    assert r["old_s"] == 0.0  # no pass of its own
    assert r["param_moved"] > 1e-4 and r["param_diff"] < 1e-6  # the same (non-zero) update
    assert r["gap_keys"], "the engine-vs-trainer gap is still measured"
    assert r["fused"].keys() == r["split"].keys() and len(r["fused"]) > 3
    for k, v in r["split"].items():
        assert r["fused"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
