"""scripts/bench_microbatch.py end to end on the tiny HybridMoe: both arms run in their own processes
through the real `PolicyTrainer` on a step padded to its longest episode, and the table reports both
as ratios to the batch-order arm. (The arms' numerical equivalence is tests/rl/trainer/test_batch.py's.)"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def test_bench_microbatch_runs_both_arms_on_the_tiny_model():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_microbatch.py"), "--model", "tiny", "--seqs", "8",
                          "--short", "40", "--long", "120", "--long-share", "0.5", "--micro-batch", "2", "--steps", "1",
                          "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in
            re.finditer(r"^(batch order, full width|length-grouped, cut)\s+([\d.]+)\s+([\d.]+)x", out.stdout, re.M)}
    assert set(rows) == {"batch order, full width", "length-grouped, cut"}
    assert rows["batch order, full width"][1] == 1.00 and rows["length-grouped, cut"][0] > 0
    width = int(re.search(r"padded width (\d+)", out.stdout).group(1))
    assert 110 <= width <= 132  # the step is padded to its longest episode (120 +- 10%)
