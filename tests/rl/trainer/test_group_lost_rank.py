"""A trainer rank that dies mid-run is named in the driver's error: its rank, why its process exited and
where its log is, not the surviving rank's collective error ("Connection closed by peer"). A rank whose
call fails while its process lives is named with its own error, whichever rank's error Ray returns first."""
from __future__ import annotations

import os
import signal

import pytest

from tests.rl.trainer.test_group import ray_local  # noqa: F401  (the module's local Ray)
from tests.rl.trainer.test_policy import _episodes

pytestmark = pytest.mark.slow


def test_a_killed_rank_is_named_with_its_exit_and_log(ray_local, tmp_path):
    from model.shipped import build_random_checkpoint
    from rl.objective import RLObjective
    from rl.trainer.batch import collate
    from rl.trainer.group import TrainerGroup, TrainerLostError, TrainerStepError
    from rl.trainer.policy import TrainerSpec

    init = str(build_random_checkpoint("tiny", tmp_path / "init", seed=0))
    env = {k: v for k, v in os.environ.items() if k.startswith(("JOINTRL_", "TORCH_EXTENSIONS", "HF_", "TRANSFORMERS_"))}
    g = TrainerGroup.start(init, TrainerSpec(zero_stage=3, lr=1e-3, micro_batch_size=2), RLObjective(), num_ranks=2, env=env)
    try:
        g.ready()
        with pytest.raises(TrainerStepError, match=r"^trainer rank 1 failed: .*nonexistent"):
            g._get([g.workers[0].version.remote(), g.workers[1].load_reference.remote(str(tmp_path / "nonexistent"))])
        victim = g.processes[1]
        assert victim.pid > 0 and os.path.exists(victim.log)
        os.kill(victim.pid, signal.SIGKILL)  # rank 0's next gather finds its peer gone
        with pytest.raises(TrainerLostError) as info:
            g.rl_step(collate(_episodes(4, 32, 8192, 2), [1.0, -1.0, 1.0, -1.0], domains=("a", "b")))
    finally:
        g.kill()
    msg = str(info.value)
    print(msg)
    assert msg.startswith(f"trainer rank 1 was lost (pid {victim.pid}") and victim.log in msg
    assert "trainer rank 0" not in msg  # the survivor is not blamed
    assert "exit" in msg.lower() or "killed" in msg.lower()  # Ray's death cause is carried over
