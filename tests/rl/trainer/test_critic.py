"""The PPO critic (rl/trainer/critic.py) on a real DeepSpeed engine (gloo, CPU, tiny HybridMoe), with
the driver's token-level advantages (rl/train.py `with_advantages`).

Checks: the value head starts at zero; GAE advantages computed by the driver on the critic's
recorded values equal the loop reference written from the definition; repeated PPO updates on one
batch make the clipped value loss fall. Runs in a spawned process (torch.distributed is
process-global), like test_policy.py.
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
    from dataclasses import replace

    from model.shipped import build_random_checkpoint, load_shipped_config
    from rl.algos import aggregation_weights
    from rl.config import AlgorithmSection
    from rl.objective import RLObjective
    from rl.train import with_advantages
    from rl.trainer.actor import TrainerWorker
    from rl.trainer.batch import collate
    from rl.trainer.critic import CriticSpec
    from rl.trainer.policy import TrainerSpec
    from tests.rl.algos.algos_refs import ref_gae, ref_outcome_rewards

    init = build_random_checkpoint("tiny", f"{tmp}/init", seed=0)
    vocab = load_shipped_config("tiny").vocab_size
    eps = [replace(e, reward=float(i % 3 == 0)) for i, e in enumerate(_episodes(6, 40, vocab, 2))]
    batch = collate(eps, [0.0] * 6, domains=("a", "b"))
    w, _ = aggregation_weights("token_mean", batch.loss_mask_BT > 0)
    batch = batch.with_(loss_weights_BT=w)
    a = AlgorithmSection(advantage="gae", gamma=0.99, lam=0.9, whiten_advantages=False)  # the raw GAE vs its reference
    worker = TrainerWorker(str(init), TrainerSpec(lr=1e-4, micro_batch_size=3, routing_replay="off"),
                           RLObjective(tis_cap=0.0, router_aux_coef=0.0), critic=CriticSpec(lr=3e-3, micro_batch_size=3))
    mask = batch.loss_mask_BT > 0
    first = worker.values(batch)
    losses, gae_err, explained = [], [], []
    for _ in range(6):
        values = worker.values(batch)
        b, _ = with_advantages(batch, a, values)
        ref = ref_gae(ref_outcome_rewards(batch.rewards_B.tolist(), mask), values.tolist(), mask, a.gamma, a.lam)
        import torch

        gae_err.append(float((b.advantages_BT - torch.tensor(ref)).abs().max()))
        m = worker.rl_step(b)
        losses.append(m["value/loss"])
        explained.append(m["value/explained_var"])
    return {"first_abs_max": float(first.abs().max()), "losses": losses, "gae_err": gae_err, "explained": explained,
            "off_mask_zero": bool((worker.values(batch)[~mask] == 0).all())}


def test_gae_on_recorded_values_matches_the_reference_and_the_value_loss_falls(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        r = pool.apply(_run, (str(tmp_path),))
    print(r)
    assert r["first_abs_max"] == 0.0  # zero-initialised head: the first advantages are plain returns
    assert max(r["gae_err"]) < 1e-5
    assert r["off_mask_zero"]
    assert r["losses"][-1] < 0.5 * r["losses"][0], r["losses"]
    assert r["explained"][-1] > r["explained"][0]
