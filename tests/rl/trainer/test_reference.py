"""The KL reference on a real DeepSpeed trainer (gloo, CPU, tiny HybridMoe): the logged KL is k3 of
the reference's logprobs, and a KL penalty keeps the policy closer to the reference.

Runs in a spawned process (torch.distributed is process-global), like tests/rl/trainer/test_policy.py.
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
    from model.shipped import build_random_checkpoint, load_shipped_config
    from rl.algos import aggregation_weights
    from rl.objective import RLObjective
    from rl.trainer.actor import TrainerWorker
    from rl.trainer.batch import collate
    from rl.trainer.policy import TrainerSpec

    init = build_random_checkpoint("tiny", f"{tmp}/init", seed=0)
    cfg = load_shipped_config("tiny")
    eps = _episodes(6, 40, cfg.vocab_size, 0)
    batch = collate(eps, [1.0, -1.0] * 3, domains=("a", "b"))
    w, _ = aggregation_weights("token_mean", batch.loss_mask_BT > 0)
    batch = batch.with_(loss_weights_BT=w)
    mask = batch.loss_mask_BT > 0
    out: dict = {}
    for coef in (0.0, 1.0):
        worker = TrainerWorker(str(init), TrainerSpec(lr=3e-3, micro_batch_size=3, routing_replay="off"),
                               RLObjective(kl_coef=coef, tis_cap=0.0, router_aux_coef=0.0))
        worker.load_reference(str(init))
        logged, expected = [], []
        for _ in range(4):
            # From the formula: k3 = exp(ref - old) - (ref - old) - 1 on generated tokens, mean over them.
            old, _ = worker.compute_logprobs(batch)
            ref = worker.reference_logprobs(batch)
            log_r = (ref - old)[mask].double()
            expected.append(float((log_r.exp() - log_r - 1).mean()))
            logged.append(worker.rl_step(batch)["kl/ref_mean"])
        old, _ = worker.compute_logprobs(batch)
        log_r = (worker.reference_logprobs(batch) - old)[mask].double()
        out[coef] = {"logged": logged, "expected": expected, "final_kl": float((log_r.exp() - log_r - 1).mean()),
                     "ref_equals_initial": expected[0] == 0.0}
        del worker  # the process group stays up; the next worker reuses it
    return out


def test_logged_kl_is_k3_of_the_reference_and_the_penalty_keeps_the_policy_close(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        r = pool.apply(_run, (str(tmp_path),))
    print({c: {k: v for k, v in d.items()} for c, d in r.items()})
    for coef in (0.0, 1.0):
        assert r[coef]["ref_equals_initial"]  # step 0: the policy is the reference, KL exactly 0
        for got, want in zip(r[coef]["logged"], r[coef]["expected"]):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-7)
        assert r[coef]["final_kl"] > 0  # the updates moved the policy
    # Same batch, seed and steps: with the KL term the policy ends closer to the reference.
    assert r[1.0]["final_kl"] < 0.8 * r[0.0]["final_kl"], r
