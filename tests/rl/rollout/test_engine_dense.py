"""RolloutEngine on a tiny dense Qwen3 (fp32, head_dim 64, tied embeddings) against HF in a separate process.

Dense models need no MoE fix; this checks the generic in-place update path (fused q/k/v and gate/up,
tied embeddings, no lm_head sent) after several successive updates.
"""
from __future__ import annotations

import pytest
import torch

from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine
from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint
from tests.helpers.reference import ReferenceJob, run_reference
from rl.weights import make_buckets, unpack_bucket

from tests.rl.rollout.rollout_helpers import cut_at_eos, fixed_sequences, max_abs_diff

pytestmark = pytest.mark.slow

TOL = 1e-4
SEQS = fixed_sequences(3, 40, seed=7)
PROMPTS = tuple(s[:6] for s in SEQS)
STEPS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("dense"), TinyModelSpec(kind="qwen3", tie_word_embeddings=True, seed=3))
    ref = run_reference(ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path_factory.mktemp("ref")), sequences=SEQS,
                                     prompts=PROMPTS, greedy_new_tokens=10, num_steps=STEPS, perturb_scale=0.1))
    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=128, kv_cache_gib=0.25))
    yield eng, ref
    eng.shutdown()


def _check(eng, state):
    diff = max_abs_diff(eng.score(SEQS), state["logprobs"])
    assert diff <= TOL, diff
    got = eng.generate([GenerateRequest(prompt_token_ids=p, max_tokens=10, temperature=0.0) for p in PROMPTS])
    assert [cut_at_eos(g.token_ids) for g in got] == [cut_at_eos(w) for w in state["greedy"]]


def test_dense_engine_matches_hf_before_and_after_successive_updates(setup):
    eng, ref = setup
    assert eng.num_experts is None
    _check(eng, ref[0])
    for step in range(1, STEPS + 1):
        state = torch.load(ref[step]["state_path"])
        (bucket,) = make_buckets(state, "qwen3", bucket_mb=64, tie_word_embeddings=True)
        assert "lm_head.weight" not in bucket.names
        stats = eng.update_weights(unpack_bucket(bucket))
        assert stats.repacked_moe_layers == 0 and stats.policy_version == step
        assert max_abs_diff(eng.score(SEQS), ref[step - 1]["logprobs"]) > 100 * TOL
        _check(eng, ref[step])
