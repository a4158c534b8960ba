"""scripts/bench_knobs.py end to end on the tiny HybridMoe: every knob row runs through the real
`PolicyTrainer` in its own process and the table reports each as a ratio to the fp32 / 1-thread row,
with the trainable-parameter counts the knobs imply."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def test_bench_knobs_runs_every_row_on_the_tiny_model():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_knobs.py"), "--model", "tiny", "--batch", "4", "--tokens", "64",
                          "--gen", "16", "--micro", "2", "--rounds", "1"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m.group(1).strip(): (float(m.group(2)), float(m.group(3)), float(m.group(4))) for m in
            re.finditer(r"^(fp32.*?|bf16.*?)\s+([\d.]+)M\s+[\d.]+\s+[\d.]+\s+([\d.]+)x\s+([\d.]+)$", out.stdout, re.M)}
    assert len(rows) == 6, out.stdout
    full = rows["fp32, 1 thread"][0]
    assert rows["fp32, 1 thread"][1] == 1.00 and all(r[2] > 0 for r in rows.values())
    assert rows["fp32, 2 threads"][0] == rows["bf16 weights, 2 threads"][0] == full
    frozen = next(v for k, v in rows.items() if "frozen" in k)
    assert 0 < frozen[0] < full
    # LoRA trains adapters only; adding the experts' adapters adds trainable parameters
    assert 0 < rows["fp32, 2 threads, LoRA r16 attention"][0] < rows["fp32, 2 threads, LoRA r16 attention+experts"][0] < frozen[0]
