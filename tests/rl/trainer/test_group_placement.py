"""TrainerGroup.start's bounded wait for its placement group: the refusal names what was asked and what the cluster has.

Only the message is checked here (`placement_problem`, pure): the wait itself needs a Ray cluster short of
resources, which a fast test cannot start; the e2e runs place their groups in seconds.
"""
from __future__ import annotations

from rl.trainer.group import PLACEMENT_TIMEOUT_S, placement_problem


def test_a_resource_the_cluster_lacks_is_named_with_asked_total_and_free():
    msg = placement_problem([{"CPU": 2.0, "GPU": 1.0}] * 2, "PACK", {"CPU": 4.0, "GPU": 1.0}, {"CPU": 1.0}, 300)
    assert "not placed in 300 s" in msg and "2 bundle(s) of {'CPU': 2.0, 'GPU': 1.0}" in msg
    assert "GPU 2 (cluster 1, free 0)" in msg and "CPU 4 (cluster 4, free 1)" in msg
    assert "less GPU than asked" in msg and "less CPU" not in msg
    for key in ("trainer.num_workers", "trainer.cpus_per_rank", "trainer.gpus_per_rank", "trainer.node_resource"):
        assert key in msg


def test_enough_in_all_but_not_free_or_not_spread_says_so():
    msg = placement_problem([{"CPU": 1.0, "trainer_node": 0.001}] * 3, "STRICT_SPREAD", {"CPU": 8.0, "trainer_node": 1.0},
                            {"CPU": 8.0, "trainer_node": 1.0}, 5)
    assert "trainer_node 0.003 (cluster 1, free 1)" in msg
    assert "not free, or not on the nodes the strategy needs (STRICT_SPREAD: one bundle a node)" in msg


def test_the_wait_is_bounded_by_default():
    import inspect

    from rl.trainer.group import TrainerGroup

    assert 0 < PLACEMENT_TIMEOUT_S < float("inf")
    assert inspect.signature(TrainerGroup.start).parameters["placement_timeout_s"].default == PLACEMENT_TIMEOUT_S
