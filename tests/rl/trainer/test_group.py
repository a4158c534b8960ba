"""rl/trainer/group.py: N DeepSpeed ranks as Ray actors in a placement group, on real DeepSpeed (gloo).

The check is the one that matters for scaling out: the same batch gives the same parameters after an
update on 1 rank and on 2, for ZeRO 1, 2 and 3 (token-balanced shards, global loss weights, padded
micro-batches), and sync/checkpoint paths see the full weights under ZeRO-3.
"""
from __future__ import annotations

import pytest

from tests import REPO
from tests.rl.trainer.test_policy import _episodes

pytestmark = pytest.mark.slow


def test_split_micro_batches_deals_whole_micro_batches_and_keeps_every_row_once():
    import torch

    from rl.trainer.batch import collate, micro_rows, split_micro_batches

    eps = _episodes(7, 40, 500, 3)
    batch = collate(eps, [1.0] * 7)
    lengths = batch.attention_mask_BT.sum(1).tolist()
    parts = split_micro_batches(batch, 3, 2)
    assert sorted(i for p in parts for i in p) == list(range(7))
    whole = micro_rows(batch, 2)
    # each rank's shard rebuilds exactly micro-batches of the one-rank step (same rows, same order)
    for p in parts:
        shard_mbs = [[p[j] for j in rows] for rows in micro_rows(batch.select(p), 2)]
        assert all(mb in whole for mb in shard_mbs)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(sum(lengths[i] for i in mb) for mb in whole)  # LPT over micro-batches
    assert split_micro_batches(batch, 9, 2)[4:] == [[]] * 5  # more ranks than micro-batches: some get none
    with pytest.raises(ValueError):
        split_micro_batches(batch, 0, 2)
    shard = batch.select(parts[0])
    assert shard.step_seqs == 7 and shard.step_tokens == int(batch.attention_mask_BT.sum())
    assert shard.step_loss_tokens == pytest.approx(float(batch.loss_mask_BT.sum()))
    assert torch.equal(shard.input_ids_BT, batch.input_ids_BT[torch.as_tensor(parts[0])])


def test_reduce_rank_metrics_sums_maxes_and_weights_by_sequences():
    from rl.trainer.group import reduce_rank_metrics

    m = reduce_rank_metrics([{"train/seqs": 3.0, "train/tokens": 30.0, "train/step_s": 1.0, "train/grad_norm": 2.0, "loss/x": 1.0,
                              "train/rss_gb": 9.0},
                             {"train/seqs": 1.0, "train/tokens": 10.0, "train/step_s": 3.0, "train/grad_norm": 2.0, "loss/x": 5.0,
                              "train/rss_gb": 7.0}]).as_metrics()
    assert m == {"train/seqs": 4.0, "train/tokens": 40.0, "train/step_s": 3.0, "train/grad_norm": 2.0, "loss/x": 2.0, "train/rss_gb": 9.0}
    with pytest.raises(ValueError, match="'train/new_thing' has no field in TrainResult"):  # never a silent weighted mean
        reduce_rank_metrics([{"train/seqs": 1.0, "train/new_thing": 1.0}])


@pytest.fixture(scope="module")
def ray_local():
    import os

    os.environ.setdefault("JOINTRL_CACHE", str(REPO / ".cache"))
    from rl.paths import setup_cache_env

    setup_cache_env()
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=os.environ.get("RAY_TMPDIR"))
    yield
    ray.shutdown()


def _update(init: str, zero_stage: int, ranks: int, batch, sp: int = 1) -> tuple[dict, dict]:
    import os

    import ray

    from rl.objective import RLObjective
    from rl.trainer.group import TrainerGroup
    from rl.trainer.policy import TrainerSpec
    from rl.weights import unpack_bucket

    env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "TORCH_EXTENSIONS", "HF_", "TRANSFORMERS_"))}
    g = TrainerGroup.start(init, TrainerSpec(zero_stage=zero_stage, lr=1e-3, micro_batch_size=2, routing_replay="auto",
                                             sequence_parallel_size=sp),
                           RLObjective(router_aux_coef=0.01), num_ranks=ranks, env=env)
    try:
        m = g.rl_step(batch)
        refs = g.export_weights(1024.0)
        state = {n: t.clone() for r in refs for n, t in unpack_bucket(ray.get(r))}
        return state, m
    finally:
        g.kill()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_one_and_two_ranks_compute_the_same_update(ray_local, tmp_path, zero_stage):
    import torch

    from model.shipped import build_random_checkpoint
    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate

    init = str(build_random_checkpoint("tiny", tmp_path / "init", seed=0))
    eps = _episodes(5, 48, 8192, 1)  # odd count and ragged lengths: unequal shards, padded micro-batches
    batch = collate(eps, [1.0, -1.0, 0.5, -0.5, 1.0], domains=("a", "b"))
    w, _ = aggregation_weights("domain_token_mean", batch.loss_mask_BT > 0, domain_ids_B=batch.domain_ids_B)
    batch = batch.with_(loss_weights_BT=w)
    s1, m1 = _update(init, zero_stage, 1, batch)
    s2, m2 = _update(init, zero_stage, 2, batch)
    assert m1["trainer/world_size"] == 1 and m2["trainer/world_size"] == 2
    assert m2["train/seqs"] == 5 and m2["train/tokens"] == m1["train/tokens"]
    assert s1.keys() == s2.keys() and len(s1) > 10
    worst = max(float((s1[n] - s2[n]).abs().max()) for n in s1)
    print(f"ZeRO-{zero_stage}: max |1 rank - 2 ranks| = {worst:.3g}, grad norm {m1['train/grad_norm']:.6g} vs {m2['train/grad_norm']:.6g}")
    assert worst <= 1e-5, f"ZeRO-{zero_stage}: 1 vs 2 ranks differ by {worst:.3g}"
    from safetensors.torch import load_file

    init_sd = load_file(f"{init}/model.safetensors")
    moved = [n for n in s1 if n in init_sd and not torch.equal(s1[n], init_sd[n])]
    assert len(moved) > len(s1) // 2  # the update changed most tensors, and both runs agree on them
    # Adam's first step is nearly invariant to the gradient's scale; the global grad norm is not, so
    # it is what shows the shards' losses add up to the one-rank loss (no factor of world size lost).
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-4)


def test_two_ranks_sharing_each_sequence_through_the_group(ray_local, tmp_path):
    """`trainer.sequence_parallel_size=2` on 2 ranks (one group, data-parallel size 1) through the group's sharding
    and metric reduction: the one-rank update, each row and token counted once (the split itself, on a Mixtral too:
    tests/rl/trainer/test_sequence_parallel.py)."""
    from model.shipped import build_random_checkpoint
    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate

    init = str(build_random_checkpoint("tiny", tmp_path / "init", seed=0))
    batch = collate(_episodes(5, 48, 8192, 1), [1.0, -1.0, 0.5, -0.5, 1.0], domains=("a", "b"))
    w, _ = aggregation_weights("domain_token_mean", batch.loss_mask_BT > 0, domain_ids_B=batch.domain_ids_B)
    batch = batch.with_(loss_weights_BT=w)
    s1, m1 = _update(init, 1, 1, batch)
    s2, m2 = _update(init, 1, 2, batch, sp=2)
    worst = max(float((s1[n] - s2[n]).abs().max()) for n in s1)
    assert worst <= 1e-5, f"1 rank vs 2 ranks sharing each sequence differ by {worst:.3g}"
    assert m2["trainer/world_size"] == 2 and m2["train/seqs"] == 5 and m2["train/tokens"] == m1["train/tokens"]
    assert m2["train/micro_batches"] == m1["train/micro_batches"]
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-4)
