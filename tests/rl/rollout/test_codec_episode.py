"""A real episode through the `hf` codec: SmolLM2-135M-Instruct (model.hub.pull) on a vLLM engine, the real
terminal environment in its sandbox, tools presented Hermes-style and parsed by vLLM's `hermes` parser.

Checks token-in / token-out exactly: every request's prompt is the episode's prefix, every turn's generated
ids (and logprobs) sit in the episode unchanged with loss mask 1, stop ids come from the checkpoint's own
tokenizer, and a format without a reasoning block gets no thinking budget.
"""
from __future__ import annotations

import asyncio

import pytest

from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_episode
from rl.rollout.codec import default_codec_name, make_codec
from rl.rollout.codec.hf import HERMES_TOOLS_HEADER
from rl.rollout.engine import EngineConfig, RolloutEngine

pytestmark = pytest.mark.slow
pytest.importorskip("envs.terminal")


@pytest.fixture(scope="module")
def engine_and_codec():
    from model import hub

    ckpt = hub.pull("smollm2-135m")
    codec = make_codec(default_codec_name(str(ckpt)), ckpt, tool_parser="hermes")
    markers = codec.reasoning_markers
    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="float32", max_model_len=2048, kv_cache_gib=0.5,
                                     reasoning_start=markers[0] if markers else None,
                                     reasoning_end=markers[1] if markers else None))
    yield eng, codec
    eng.shutdown()


def test_hf_codec_episode_on_smollm2_appends_exactly_the_generated_tokens(engine_and_codec):
    import envs
    from jointrl.records import Task

    eng, codec = engine_and_codec
    assert codec.name == "hf" and codec.reasoning_markers is None
    seen: list[tuple] = []

    async def generate_batch(reqs):
        res = await asyncio.to_thread(eng.generate, reqs)
        seen.extend(zip(reqs, res))
        return res

    task = Task.from_row(envs.tasks("terminal-v0", "train", seed=0, n=1)[0])
    settings = LoopSettings(max_model_len=2048, max_new_tokens_per_turn=48, temperature=0.0, max_turns=3,
                            thinking_budgets={"low": 32, "high": 48, "max": -1})
    ep = asyncio.run(run_episode(envs.make("terminal-v0"), task, BatchingGenerator(generate_batch), codec.tokenizer, codec,
                                 settings, group_id="g"))
    assert ep.grade_error is None and ep.num_turns == 3 == len(seen)
    ids, mask, lps = list(ep.token_ids), list(ep.loss_mask), list(ep.rollout_logprobs)
    im_end = codec.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for req, res in seen:
        p, out = list(req.prompt_token_ids), list(res.token_ids)
        assert ids[: len(p)] == p  # the request is the episode so far: nothing re-tokenised
        assert ids[len(p): len(p) + len(out)] == out and set(mask[len(p): len(p) + len(out)]) == {1}
        assert lps[len(p): len(p) + len(out)] == pytest.approx(list(res.logprobs))
        assert im_end in req.stop_token_ids and req.thinking_budget is None
        assert req.max_tokens <= 32 if task.thinking == "low" else req.max_tokens <= 48  # the tier caps the turn
    assert sum(mask) == sum(len(r.token_ids) for _, r in seen)
    text = codec.tokenizer.decode(ids, skip_special_tokens=False)
    assert HERMES_TOOLS_HEADER in text  # SmolLM2's template has no tool section: Hermes-style schemas in the system turn
    # Three generation prompts, and the last environment turn's delta ends with a fourth (then max_turns ends it).
    assert text.count("<|im_start|>assistant\n") == 4
    # Each environment turn is the template's delta, appended right after the assistant turn's <|im_end|>
    # (the engine's own, or one the loop adds with loss mask 0 when the turn hit its token cap).
    for (r, o), (nxt, _) in zip(seen, seen[1:]):
        end = len(r.prompt_token_ids) + len(o.token_ids)
        if o.token_ids[-1] != im_end:
            assert ids[end] == im_end and mask[end] == 0
            end += 1
        delta = codec.tokenizer.decode(list(nxt.prompt_token_ids[end:]), skip_special_tokens=False)
        assert delta.startswith(("\n<|im_start|>user\n", "\n<|im_start|>tool\n")) and delta.endswith("<|im_start|>assistant\n")
