"""scripts/bench_packing.py end to end on a tiny random Mixtral: both arms run through the real
`PolicyTrainer` in their own processes, and the table shows the packed arm computing each group's prompt
once (fewer positions than the padded arm, over the same real tokens)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def test_bench_packing_runs_both_arms_on_a_tiny_mixtral(tmp_path):
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "mixtral", TinyModelSpec(kind="mixtral", num_experts=4, top_k=2))
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_packing.py"), "--model", str(model), "--groups", "2",
                          "--group-size", "4", "--prompt", "80", "--gen", "12", "--micro", "4", "--rounds", "1", "--threads", "1", "--frozen-layers", "0"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)), float(m.group(4))) for m in
            re.finditer(r"^(on|off)\s+(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)x\s+[\d.]+$", out.stdout, re.M)}
    assert set(rows) == {"on", "off"}, out.stdout
    assert rows["on"][0] == rows["off"][0]                      # the same real tokens
    assert rows["off"][1] >= rows["off"][0]                     # padded: every row's positions, padding included
    assert rows["on"][1] < 0.5 * rows["off"][1]                 # packed: 2 prompts of 80 once, not 8 times
    assert rows["off"][2] == 1.00 and rows["on"][2] > 0
