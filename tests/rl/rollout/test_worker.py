"""RolloutWorkerImpl used in-process (no actor): what it must not do to the calling process."""
from __future__ import annotations

import subprocess
import sys

from tests import REPO


def test_resolving_plain_values_does_not_start_ray():
    # ray.get of even an empty list starts a local Ray instance in a process without one; an in-process
    # worker given plain tensors (tests, the serving path) must leave Ray alone.
    code = ("import ray\n"
            "from rl.rollout.worker import _resolve_all\n"
            "assert _resolve_all([1, 'a', None]) == [1, 'a', None]\n"
            "print('ray up' if ray.is_initialized() else 'ray down')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ray down"
