"""`algorithm.whiten_advantages` in a short PPO run: a real DeepSpeed trainer (gloo, CPU, tiny HybridMoe)
with its zero-initialised critic, the driver's advantages (rl/train.py `with_advantages`), 3 updates of
one batch, once with whitening off and once with it on, from the same initial weights.

What whitening changes here: with a critic that starts at zero, GAE's first advantages are the
returns, all >= 0 for 0/1 rewards, so PPO can only push up the tokens of rewarded episodes; the
failed episodes' tokens get no negative signal. Whitened, the failed episodes' tokens carry negative
advantages and their logprobs fall. The test asserts exactly that, and prints the figures quoted in
docs/training.md. Each setting runs in its own spawned process (torch.distributed is process-global).
"""
from __future__ import annotations

import multiprocessing as mp

import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def _run(tmp: str, whiten: bool) -> dict:
    import os

    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    from dataclasses import replace

    import torch

    from model.shipped import build_random_checkpoint, load_shipped_config
    from rl.algos import aggregation_weights
    from rl.config import AlgorithmSection
    from rl.objective import RLObjective
    from rl.train import with_advantages
    from rl.trainer.actor import TrainerWorker
    from rl.trainer.batch import collate
    from rl.trainer.critic import CriticSpec
    from rl.trainer.policy import TrainerSpec
    from tests.rl.trainer.test_policy import _episodes

    torch.manual_seed(0)
    init = build_random_checkpoint("tiny", f"{tmp}/init-{whiten}", seed=0)
    vocab = load_shipped_config("tiny").vocab_size
    eps = [replace(e, reward=float(i % 2)) for i, e in enumerate(_episodes(8, 40, vocab, 3))]
    batch = collate(eps, [0.0] * 8, domains=("a", "b"))
    w, _ = aggregation_weights("token_mean", batch.loss_mask_BT > 0)
    batch = batch.with_(loss_weights_BT=w)
    a = AlgorithmSection(advantage="gae", gamma=1.0, lam=0.95, whiten_advantages=whiten)
    worker = TrainerWorker(str(init), TrainerSpec(lr=3e-4, micro_batch_size=4, routing_replay="off"),
                           RLObjective(tis_cap=0.0, router_aux_coef=0.0), critic=CriticSpec(lr=1e-3, micro_batch_size=4))
    mask = batch.loss_mask_BT > 0
    lp0, _ = worker.compute_logprobs(batch)
    adv_stats = []
    for _ in range(3):
        b, m = with_advantages(batch, a, worker.values(batch))
        sel = b.advantages_BT[mask]
        adv_stats.append((float(sel.mean()), float(sel.std()), float((sel < 0).float().mean())))
        worker.rl_step(b)
    lp1, _ = worker.compute_logprobs(batch)
    d_BT = (lp1 - lp0).float()
    rewarded = batch.rewards_B > 0
    tok = lambda rows: float(d_BT[mask & rows[:, None]].mean())  # noqa: E731
    return {"adv": adv_stats, "dlogp_rewarded": tok(rewarded), "dlogp_failed": tok(~rewarded)}


def test_whitening_gives_failed_episodes_negative_advantages_and_lowers_their_logprobs(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(2, maxtasksperchild=1) as pool:  # one process per setting, side by side
        off_on = pool.starmap(_run, [(str(tmp_path), False), (str(tmp_path), True)])
    out = dict(zip((False, True), off_on))
    print({k: v for k, v in out.items()})
    off, on = out[False], out[True]
    mean0, std0, neg0 = off["adv"][0]
    assert neg0 == 0.0 and mean0 > 0  # unwhitened, zero critic: every advantage is a return >= 0
    for mean, std, neg in on["adv"]:
        assert abs(mean) < 1e-5 and std == pytest.approx(1.0, abs=1e-3) and neg > 0.2
    assert on["dlogp_failed"] < 0 < on["dlogp_rewarded"]  # whitened: failures pushed down, successes up
    assert on["dlogp_failed"] < off["dlogp_failed"] - 0.01
