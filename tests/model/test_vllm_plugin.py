"""model/vllm_plugin.py: HybridMoe served by vLLM's Qwen3-Next path (bf16 on CPU), refusals, safe registration.

The slow test measures the bf16 engine's logprob gap to HF fp32 and compares it with HF's own
bf16-vs-fp32 gap on the same weights (the issue asks to measure and report it, not hide it), before
and after an in-place weight update.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from model.configuration import HybridMoeConfig
from model.shipped import load_shipped_config
from model.vllm_plugin import HybridMoeServingError, check_servable, register

from tests.rl.rollout.rollout_helpers import fixed_sequences, max_abs_diff


def test_dsa_layers_are_refused_when_context_exceeds_index_topk():
    cfg = load_shipped_config("tiny", index_topk=256)
    with pytest.raises(HybridMoeServingError, match=r"max_model_len \(512\) <= index_topk \(256\)"):
        check_servable(cfg, 512, torch.bfloat16, is_cpu=True)
    check_servable(cfg, 256, torch.bfloat16, is_cpu=True)  # exactly k visible keys: dense == DSA
    no_dsa = load_shipped_config("tiny", index_topk=256, layer_types=["linear_attention"] * cfg.num_hidden_layers)
    check_servable(no_dsa, 4096, torch.bfloat16, is_cpu=True)  # no DSA layer: any length


def test_cpu_needs_bf16_and_supported_head_dims():
    cfg = load_shipped_config("tiny")
    with pytest.raises(HybridMoeServingError, match="requires bfloat16"):
        check_servable(cfg, 256, torch.float32, is_cpu=True)
    check_servable(cfg, 256, torch.float32, is_cpu=False)
    odd = load_shipped_config("tiny", linear_key_head_dim=32, index_head_dim=32)
    with pytest.raises(HybridMoeServingError, match="linear_key_head_dim"):
        check_servable(odd, 256, torch.bfloat16, is_cpu=True)


def test_register_is_idempotent_and_never_raises(monkeypatch, caplog):
    from transformers import AutoConfig
    from vllm import ModelRegistry

    register()
    register()
    assert "HybridMoeForCausalLM" in ModelRegistry.get_supported_archs()
    assert AutoConfig.for_model("hybrid_moe").__class__ is HybridMoeConfig
    monkeypatch.setitem(sys.modules, "model.configuration", None)  # a broken model package ...
    register()  # ... is logged, not raised: vLLM keeps serving other models
    assert "not registered" in caplog.text


@pytest.mark.slow
def test_bf16_engine_gap_is_within_hf_own_bf16_noise_before_and_after_an_update(tmp_path):
    from rl.rollout.engine import EngineConfig, EngineError, GenerateRequest, RolloutEngine
    from tests.helpers.reference import ReferenceJob, run_reference
    from model.shipped import build_random_checkpoint
    from rl.weights import make_buckets, unpack_bucket

    ckpt = build_random_checkpoint("tiny", tmp_path / "hyb")
    seqs = fixed_sequences(4, 64, seed=1, low=20, high=8000)
    r32 = run_reference(ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path / "r32"), sequences=seqs, num_steps=1, perturb_scale=0.2))
    r16 = run_reference(ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path / "r16"), sequences=seqs, num_steps=1, perturb_scale=0.2,
                                     dtype="bfloat16"))
    with pytest.raises(HybridMoeServingError, match="bfloat16"):  # refused before the engine starts
        RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=256))
    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="auto", max_model_len=512, kv_cache_gib=0.25))
    try:
        assert eng.dtype == "bfloat16"
        report = []
        for step in (0, 1):
            if step == 1:
                (bucket,) = make_buckets(torch.load(r32[1]["state_path"]), "hybrid_moe", bucket_mb=1000)
                eng.update_weights(unpack_bucket(bucket))
            got = eng.score(seqs)
            engine_gap = max_abs_diff(got, r32[step]["logprobs"])
            hf_gap = max_abs_diff(r16[step]["logprobs"], r32[step]["logprobs"])
            mean_engine = float(np.mean([np.abs(a - b).mean() for a, b in zip(got, r32[step]["logprobs"])]))
            mean_hf = float(np.mean([np.abs(a - b).mean() for a, b in zip(r16[step]["logprobs"], r32[step]["logprobs"])]))
            report.append((step, engine_gap, hf_gap, mean_engine, mean_hf))
            print(f"state {step}: engine bf16 vs HF fp32 max {engine_gap:.4f} mean {mean_engine:.5f}; "
                  f"HF bf16 vs HF fp32 max {hf_gap:.4f} mean {mean_hf:.5f}")
            assert mean_engine <= 2 * mean_hf and engine_gap <= 2 * hf_gap
        # the update changed what is served by far more than the bf16 noise
        assert max_abs_diff(eng.score(seqs), r32[0]["logprobs"]) > 5 * report[1][1]
        r = eng.generate([GenerateRequest(prompt_token_ids=seqs[0][:8], max_tokens=4, temperature=0.0)])[0]
        assert len(r.token_ids) >= 1
        with pytest.raises(EngineError):
            eng.generate([GenerateRequest(prompt_token_ids=tuple(range(20, 532)), max_tokens=4)])
    finally:
        eng.shutdown()
