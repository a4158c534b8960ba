"""The learning check as a test: scripts/check_learning.py on configs/basics.yaml (the tiny HybridMoe on
terminal-basics-v0: SFT warm start, 12 GRPO steps, held-out evaluation before and after with the same
seeds). The script exits 1 unless held-out success rises by >= 0.05 at paired t >= 3, groups with signal
were kept, and the engine served the trained weights; this test runs it in its own process and also
reads the run's eval.json, so a silent exit 0 without the evaluation cannot pass.

~10 minutes on 2 cores: marked `learning`, run by CI (.ci/run) with --run-learning, skipped otherwise.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(2400)]


def test_rl_raises_held_out_success_on_terminal_basics(tmp_path: Path) -> None:
    run_dir = tmp_path / "basics-check"
    proc = subprocess.run([sys.executable, "scripts/check_learning.py", "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=2300)
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:])
    assert proc.returncode == 0, f"check_learning failed (rc {proc.returncode}):\n{tail}"
    assert "held-out success" in proc.stdout, tail
    ev = json.loads((run_dir / "eval.json").read_text())["domains"]["terminal-basics-v0"]
    assert ev["n"] == 120 and ev["success_after"] - ev["success_before"] >= 0.05 and ev["paired_t"] >= 3.0, ev
