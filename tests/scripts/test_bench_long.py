"""scripts/bench_long.py end to end on the tiny HybridMoe: every case in its own process through the real
`PolicyTrainer` (and the bare transformers floor), one row per length and setting, and the last line names the
longest length a jointrl setting trained; a case past the memory cap is killed and reported, not trained.
(The knobs' numerical equivalence is tests/rl/trainer/test_long_sequences.py's.)"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def _bench(*args: str) -> str:
    # --min-free-gb 0: a case here is small; the machine-wide memory guard would make the rows depend on other jobs
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_long.py"), "--threads", "1", "--min-free-gb", "0", *args],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_bench_long_rows_and_longest_trainable(tmp_path):
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config

    torch.manual_seed(0)
    HybridMoeForCausalLM(load_shipped_config("tiny")).save_pretrained(tmp_path / "tiny")
    out = _bench("--model", str(tmp_path / "tiny"), "--lengths", "32,64", "--settings", "all,bare")
    rows = re.findall(r"^\s*(\d+) ([\w-]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+ok$", out, re.M)
    assert [(int(L), s) for L, s, *_ in rows] == [(32, "all"), (32, "bare"), (64, "all"), (64, "bare")], out
    assert all(float(tps) > 0 and float(step) > 0 and float(cpu) > 0 for *_, tps, step, cpu in rows)
    assert all(float(total) > float(peak) for _, _, peak, total, *_ in rows)  # the whole process holds the model too
    assert out.strip().splitlines()[-1] == "longest trainable: 64 tokens"
    capped = _bench("--model", str(tmp_path / "tiny"), "--lengths", "64", "--settings", "today", "--max-rss-gb", "0.05")
    assert re.search(r"^\s*64 today .* over 0.05 GB$", capped, re.M), capped
    assert capped.strip().splitlines()[-1] == "longest trainable: 0 tokens"
