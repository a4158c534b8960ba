"""A rollout worker killed by Ray's memory monitor is restarted and its requests re-sent, like a crashed one.

Ray reports such a kill to the caller as `ray.exceptions.OutOfMemoryError`, which is not a
`RayActorError`. Pushing this machine into real memory exhaustion would endanger everything else running
on it, so the worker here is a small Ray actor that raises that same error from its first incarnation's
`generate` (the caller sees exactly what a memory-monitor kill gives it); the dispatcher and Ray are real.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class _Health:
    node_id: str
    policy_version: int


def test_oom_killed_worker_is_restarted_and_every_request_answered_once(monkeypatch):
    import time

    import ray

    from rl.rollout import dispatcher
    from rl.rollout.dispatcher import RolloutDispatcher

    if ray.is_initialized():  # a Ray instance another test left running would refuse this init
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Worker:
            def __init__(self, fail: bool) -> None:
                self.fail = fail
                self.version = 0

            def generate(self, reqs):
                if self.fail is True:
                    raise ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")
                return [f"done:{r}:v{self.version}" for r in reqs]

            def update_weights(self, refs, version):
                if self.fail == "start":  # killed while starting (below)
                    raise ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")
                self.version = version
                return None

            def health(self):
                return _Health(node_id="n", policy_version=self.version)

        made: list[bool] = []

        def factory():
            made.append(not made)  # the first worker fails, its replacements do not
            return Worker.remote(made[-1])

        d = RolloutDispatcher(factory, n=1)
        d.update_weights([ray.put(b"w")], version=3)
        out = d.generate([1, 2, 3])
        assert out == ["done:1:v3", "done:2:v3", "done:3:v3"]  # the replacement got the last sync first
        assert len(made) == 2

        # A replacement killed for memory while it starts (the peak that killed its predecessor has not
        # passed yet) is tried again after a back-off, and the run goes on.
        plan = [True, "start", False]
        made2: list = []

        def factory2():
            made2.append(plan[len(made2)])
            return Worker.remote(made2[-1])

        monkeypatch.setattr(dispatcher, "RESTART_BACKOFF_S", 0.5)
        d2 = RolloutDispatcher(factory2, n=1)
        d2.update_weights([ray.put(b"w")], version=4)
        t0 = time.perf_counter()
        assert d2.generate([7]) == ["done:7:v4"]
        assert made2 == plan and time.perf_counter() - t0 >= 0.5  # two replacements, one back-off between them
    finally:
        ray.shutdown()
