"""2 ranks under ZeRO-3 where one rank holds only padding: every pass the step makes through the
engines is made on both ranks.

A step batch with fewer micro-batches than ranks leaves a rank with a padding-only shard. Under ZeRO-3
each forward and backward gathers parameters collectively, and the per-step MoE telemetry sums over
the ranks, so a pass or a reduction that the padding rank skips leaves the other rank waiting on a
collective its peer never joins (the run hangs until gloo's timeout, then a rank dies). The passes at
stake are the ones a KL reference with R2 routing replay adds (the routes are recorded in a no-grad
pass first), the critic's update, the telemetry's all_reduce, and the LM head's calls when logprobs are
computed in tiles (a rank with more loss tokens has more tiles: each call of a ZeRO-3 head gathers it). The check: the step completes, and
the update equals the one-rank update of the same batch, as tests/rl/trainer/test_group.py checks for
plain steps.
"""
from __future__ import annotations

import pytest

from tests.rl.trainer.test_group import ray_local  # noqa: F401  (the module's local Ray)
from tests.rl.trainer.test_policy import _episodes

pytestmark = pytest.mark.slow


def _step(init: str, ranks: int, batch) -> tuple[dict, dict]:
    import os

    import ray

    from rl.objective import RLObjective
    from rl.trainer.critic import CriticSpec
    from rl.trainer.group import TrainerGroup
    from rl.trainer.policy import TrainerSpec
    from rl.weights import unpack_bucket

    env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "TORCH_EXTENSIONS", "HF_", "TRANSFORMERS_"))}
    g = TrainerGroup.start(init, TrainerSpec(zero_stage=3, lr=1e-3, micro_batch_size=16, routing_replay="auto",
                                                   logprob_tile_tokens=16),
                           RLObjective(router_aux_coef=0.01, kl_coef=0.05), num_ranks=ranks, env=env,
                           critic=CriticSpec(zero_stage=3, micro_batch_size=16, lr=1e-3))
    try:
        g.load_reference(init)
        m = g.rl_step(batch)
        refs = g.export_weights(1024.0)
        return {n: t.clone() for r in refs for n, t in unpack_bucket(ray.get(r))}, m
    finally:
        g.kill()


def test_a_padding_only_rank_joins_the_reference_r2_critic_and_telemetry_collectives(ray_local, tmp_path):
    import torch

    from model.shipped import build_random_checkpoint
    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate

    # The tiny HybridMoe replays routes (R2: on CPU the engine reports none), so a loaded reference
    # makes the step record the policy's routes in a no-grad pass before the update.
    init = str(build_random_checkpoint("tiny", tmp_path / "init", seed=0))
    batch = collate(_episodes(2, 48, 8192, 1), [1.0, -1.0], domains=("a", "b"))  # one micro-batch of 16: rank 1 pads
    w, _ = aggregation_weights("domain_token_mean", batch.loss_mask_BT > 0, domain_ids_B=batch.domain_ids_B)
    returns_BT = torch.linspace(-1.0, 1.0, batch.loss_mask_BT.numel()).reshape(batch.loss_mask_BT.shape) * batch.loss_mask_BT
    batch = batch.with_(loss_weights_BT=w, returns_BT=returns_BT, values_BT=torch.zeros_like(returns_BT))
    s1, m1 = _step(init, 1, batch)
    s2, m2 = _step(init, 2, batch)
    assert m2["trainer/world_size"] == 2 and m2["train/seqs"] == 2
    assert "kl/ref_mean" in m2 and "value/loss" in m2 and m2["train/routing_replay_r2"] == 1.0
    assert m2["value/loss"] == pytest.approx(m1["value/loss"], rel=1e-4)
    moe = [k for k in m1 if k.startswith("moe/tokens/")]
    assert moe and all(m2[k] == m1[k] for k in moe)  # the telemetry's all_reduce counted each token once
    worst = max(float((s1[n] - s2[n]).abs().max()) for n in s1)
    assert worst <= 1e-5, f"1 vs 2 ranks (one padding-only) differ by {worst:.3g}"
