"""RolloutEngine on a tiny Qwen3-MoE (fp32, head_dim 64) against HF transformers run in a separate process.

One engine for the whole module (vLLM start-up ~15 s). Tests run in file order: the ones that
change the engine's weights come last. Oracle: HF's own logprobs / greedy tokens on the same weights,
computed in a child process (tests.helpers.reference.run_reference) after each seeded perturbation.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from rl.rollout.engine import EngineConfig, EngineError, GenerateRequest, RolloutEngine
from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint
from tests.helpers.reference import ReferenceJob, run_reference
from rl.weights import make_buckets, to_checkpoint_format, unpack_bucket

from tests.rl.rollout.rollout_helpers import END_THINK_ID, THINK_ID, cut_at_eos, fixed_sequences, max_abs_diff

pytestmark = pytest.mark.slow

FP32_TOL = 1e-4  # the bar for fp32 MoE
SEQS = fixed_sequences(4, 32, seed=0)
PROMPTS = tuple(s[:8] for s in SEQS)
NEW = 12
STEPS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("moe"), TinyModelSpec(kind="qwen3_moe"))


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory):
    job = ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path_factory.mktemp("ref")), sequences=SEQS, prompts=PROMPTS,
                       greedy_new_tokens=NEW, num_steps=STEPS, perturb_scale=0.1)
    return run_reference(job)


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=256, kv_cache_gib=0.25, seed=0))
    yield eng
    eng.shutdown()


def _greedy(engine, prompts, n=NEW):
    res = engine.generate([GenerateRequest(prompt_token_ids=p, max_tokens=n, temperature=0.0) for p in prompts])
    return [r.token_ids for r in res]


def _check_against(engine, ref_state):
    diff = max_abs_diff(engine.score(SEQS), ref_state["logprobs"])
    assert diff <= FP32_TOL, f"engine vs HF logprob max diff {diff:.3g} > {FP32_TOL}"
    for got, want in zip(_greedy(engine, PROMPTS), ref_state["greedy"]):
        assert cut_at_eos(got) == cut_at_eos(want)
    return diff


def test_fresh_engine_matches_hf(engine, reference):
    _check_against(engine, reference[0])


def test_sampled_logprobs_equal_scored_logprobs(engine):
    """The logprob reported with each sampled token is the engine's log p(token | prefix) (raw, temperature 1)."""
    reqs = [GenerateRequest(prompt_token_ids=p, max_tokens=10, temperature=1.0, seed=100 + i) for i, p in enumerate(PROMPTS)]
    res = engine.generate(reqs)
    full = [tuple(r.prompt_token_ids) + g.token_ids for r, g in zip(reqs, res)]
    scored = engine.score(full)
    for r, g, s in zip(reqs, res, scored):
        assert len(g.logprobs) == len(g.token_ids) > 0
        tail = s[len(r.prompt_token_ids) - 1 :]
        np.testing.assert_allclose(np.asarray(g.logprobs), tail, atol=FP32_TOL)
        assert g.finish_reason in ("stop", "length")
    # same seed, same sample: per-request seeds make rollouts reproducible
    again = engine.generate(reqs[:1])[0]
    assert again.token_ids == res[0].token_ids


def test_concurrent_callers_are_batched_and_agree_with_one_call(engine):
    one_call = _greedy(engine, PROMPTS)
    out: dict[int, tuple] = {}

    def worker(i):
        out[i] = _greedy(engine, [PROMPTS[i]])[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [out[i] for i in range(len(PROMPTS))] == one_call


def test_thinking_budget_forces_end_of_thinking_at_the_budget(engine):
    prompts = [p + (THINK_ID,) for p in PROMPTS]
    free = _greedy(engine, prompts, n=24)
    budget = 5
    for f in free:  # precondition: unforced, the model would not close thinking by itself this early
        assert END_THINK_ID not in f[: budget + 1]
    res = engine.generate([GenerateRequest(prompt_token_ids=p, max_tokens=24, temperature=0.0, thinking_budget=budget) for p in prompts])
    for f, r in zip(free, res):
        assert r.token_ids[:budget] == f[:budget]  # thinking runs unchanged up to the budget ...
        assert r.token_ids[budget] == END_THINK_ID  # ... then `</think>` is forced ...
        assert len(r.token_ids) > budget + 1  # ... and the answer follows
        assert len(r.logprobs) == len(r.token_ids)


def test_thinking_budget_counts_thinking_tokens_already_in_the_prompt(engine):
    prompt = PROMPTS[0] + (THINK_ID, 300, 301)
    r = engine.generate([GenerateRequest(prompt_token_ids=prompt, max_tokens=12, temperature=0.0, thinking_budget=5)])[0]
    assert r.token_ids[3] == END_THINK_ID and END_THINK_ID not in r.token_ids[:3]
    r0 = engine.generate([GenerateRequest(prompt_token_ids=PROMPTS[0] + (THINK_ID,), max_tokens=4, temperature=0.0, thinking_budget=0)])[0]
    assert r0.token_ids[0] == END_THINK_ID


def test_thinking_budget_does_nothing_outside_thinking(engine):
    closed = [p + (THINK_ID, 300, END_THINK_ID) for p in PROMPTS[:2]]
    free = _greedy(engine, list(PROMPTS[:2]) + closed, n=10)
    capped = engine.generate([GenerateRequest(prompt_token_ids=p, max_tokens=10, temperature=0.0, thinking_budget=2)
                              for p in list(PROMPTS[:2]) + closed])
    assert [c.token_ids for c in capped] == free


def test_routed_experts_on_cpu_are_none_with_a_stated_reason(engine, ckpt):
    r = engine.generate([GenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=3, temperature=0.0)])[0]
    if engine.is_cpu:
        assert r.routed_experts is None
        assert not engine.routed_experts_enabled and "Triton" in engine.routed_experts_unavailable_reason
        with pytest.raises(EngineError, match="Triton"):  # refused before any engine is built
            RolloutEngine(EngineConfig(model_path=str(ckpt), routed_experts="on"))
    else:  # GPU: vLLM reports [prompt + generated - 1, layers, top_k]
        assert r.routed_experts is not None and r.routed_experts.shape[1:] == (2, 2)


def test_bad_requests_fail_clearly(engine):
    with pytest.raises(EngineError, match="prompt_token_ids is empty"):
        GenerateRequest(prompt_token_ids=(), max_tokens=3)
    with pytest.raises(EngineError, match="max_tokens"):
        GenerateRequest(prompt_token_ids=(1,), max_tokens=0)
    with pytest.raises(EngineError, match="max_model_len=256"):
        engine.generate([GenerateRequest(prompt_token_ids=tuple(range(10, 266)), max_tokens=3)])
    with pytest.raises(EngineError, match="at least 2"):
        engine.score([(5,)])
    with pytest.raises(EngineError, match="no tensors"):
        engine.update_weights([])


def test_successive_updates_match_hf_each_time(engine, reference):
    """Trainer state (fused experts) -> rl.weights buckets -> bytes -> engine, bucket by bucket, 3 times."""
    for step in range(1, STEPS + 1):
        state = torch.load(reference[step]["state_path"])
        buckets = make_buckets(state, "qwen3_moe", bucket_mb=0.5)  # several buckets, each whole layers
        assert len(buckets) > 1
        for b in buckets:
            stats = engine.update_weights(unpack_bucket(b), version=step)
            assert stats.num_bytes == b.num_bytes
        assert engine.policy_version == step
        # the previous state's logprobs are no longer served (the update really changed the model)
        assert max_abs_diff(engine.score(SEQS), reference[step - 1]["logprobs"]) > 100 * FP32_TOL
        _check_against(engine, reference[step])
        r = engine.generate([GenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=2)])[0]
        assert r.policy_version == step


def test_without_the_prepack_fix_the_moe_update_is_wrong(engine, reference):
    """Proves the CPU fix is necessary: the same update without re-prepacking serves wrong logprobs."""
    if not engine.is_cpu:
        pytest.skip("the prepack bug is specific to vLLM's CPU fused-MoE kernel")
    state = to_checkpoint_format(torch.load(reference[1]["state_path"]), "qwen3_moe")
    stats = engine.update_weights(state.items(), repack_moe=False)
    assert stats.repacked_moe_layers == 0
    broken = max_abs_diff(engine.score(SEQS), reference[1]["logprobs"])
    assert broken > 0.1, f"expected a wrong model without the fix, got max diff {broken:.3g}"
    stats = engine.update_weights(state.items())  # the same update with the fix restores exactness
    assert stats.repacked_moe_layers == 2
    _check_against(engine, reference[1])
