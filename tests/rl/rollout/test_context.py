"""Context management (rl/rollout/context.py) in the agent loop, on the long-horizon rung (terminal-longhorizon-v0).

The engine double plays the rung's scripted reference through the codec under test (each request gets the codec's
own completion ids of the next reference call, or a summary when the context ends with the summary request), so
the test controls what the "model" says; the environment, the codecs (`jointrl` and `hf` on the shipped
tokenizer), the strategies and the segment bookkeeping are the real ones. The exactness check is the contract of
segments: every segment's tokens are what the engine was given plus what it generated, nothing re-rendered.
"""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

import envs
import model.chat as chat
from jointrl.records import Message, Task
from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_episode
from rl.rollout.codec import make_codec
from rl.rollout.context import CompactionView, ContextSettings, Reply, summary_message
from rl.types import Episode, RolloutGroup, segments_of
from tests.rl.rollout.rollout_helpers import LONG_ENV as ENV
from tests.rl.rollout.rollout_helpers import TrailPolicy
from tests.rl.rollout.rollout_helpers import long_task as _task

LEN = 1024


@pytest.fixture(scope="module")
def codecs():
    return {"jointrl": make_codec("jointrl", None),
            "hf": make_codec("hf", chat.TOKENIZER_DIR, tool_parser="hermes", reasoning_parser="deepseek_r1")}


def _run(codec, strategy: str, *, task: Task | None = None, keep_turns: int = 0, budget: int = 0, summary=None,
         env=None, images=None) -> tuple[Episode, TrailPolicy]:
    task = task or _task()
    pol = TrailPolicy(codec, task, summary)
    kw = {} if images is None else {"images": images}
    settings = LoopSettings(max_model_len=LEN, max_new_tokens_per_turn=96, max_turns=40, end_token_id=codec.end_token_id,
                            context=ContextSettings(strategy=strategy, budget_tokens=budget, keep_turns=keep_turns), **kw)
    ep = asyncio.run(run_episode(env or envs.make(ENV), task, BatchingGenerator(pol), codec.tokenizer, codec, settings,
                                 group_id="g"))
    return ep, pol


def _assert_exact(ep: Episode, pol: TrailPolicy) -> None:
    """Each segment = the last request made on it + what that request generated; every request on it is a prefix;
    loss mask 1 and the engine's logprobs exactly on generated tokens."""
    segs = segments_of(ep)
    used = 0
    for s in segs:
        ids, mask, lps = list(s.token_ids), list(s.loss_mask), list(s.rollout_logprobs)
        on = []
        while used < len(pol.seen) and ids[:len(pol.seen[used][0])] == pol.seen[used][0]:
            on.append(pol.seen[used])
            used += 1
        assert on, "a segment no request was made on"
        p, out, _ = on[-1]
        assert ids == p + out  # ends with the last generated turn: nothing re-rendered, nothing appended after
        want_mask = [0] * len(ids)
        want_lps = [0.0] * len(ids)
        for p, out, lp in on:
            assert ids[len(p):len(p) + len(out)] == out
            want_mask[len(p):len(p) + len(out)] = [1] * len(out)
            want_lps[len(p):len(p) + len(out)] = lp
        assert mask == want_mask and lps == pytest.approx(want_lps)
        assert len(ids) <= LEN
    assert used == len(pol.seen)  # every request belongs to a segment


@pytest.mark.parametrize("name", ["jointrl", "hf"])
@pytest.mark.parametrize("strategy,keep", [("window", 0), ("window", 3), ("summarize", 0)])
def test_segments_are_exactly_what_the_engine_saw_and_generated(codecs, name, strategy, keep):
    codec = codecs[name]
    ep, pol = _run(codec, strategy, keep_turns=keep)
    assert ep.grade_error is None and ep.metrics["compactions"] >= 2, ep.metrics
    assert ep.metrics["segments"] == ep.metrics["compactions"] + 1 == len(segments_of(ep))
    _assert_exact(ep, pol)
    assert ep.reward == 1.0 and ep.terminated  # the reference keeps its tally in its last call: it still solves the task
    assert ep.metrics["context_tokens_max"] <= LEN
    if strategy == "window":  # the whole history, as one context would hold it, is several contexts long
        assert len(codec.prompt_ids(list(ep.messages), envs.make(ENV).tool_schemas)) > 3 * LEN
    first = segments_of(ep)[1]
    head = codec.prompt_ids(list(_task().prompt), envs.make(ENV).tool_schemas)
    assert list(first.token_ids[:len(head) - 8]) == head[:len(head) - 8]  # every context starts with system + task
    if strategy == "summarize":
        summaries = [m for m in ep.messages if m.role == "user" and m.content.startswith("Summary of your progress")]
        assert len(summaries) == ep.metrics["compactions"]
        # the summary turn is trained: it is the generated tail of every closed segment
        for s in segments_of(ep)[:-1]:
            tail = codec.tokenizer.decode([t for t, m in zip(s.token_ids, s.loss_mask) if m][-30:], skip_special_tokens=False)
            assert "logs; the last call holds my tally" in tail
    else:
        assert ep.metrics["dropped_turns"] >= 2 and ep.metrics["summary_problems"] == 0
        if keep:  # "recent N turns": each new context holds exactly the last N turns
            for s in segments_of(ep)[1:]:
                text = codec.tokenizer.decode(list(s.token_ids), skip_special_tokens=False)
                assert text.count('"read_log"') + text.count("read_log\"") >= 1


@pytest.mark.parametrize("name", ["jointrl", "hf"])
def test_full_context_truncates_where_window_finishes(codecs, name):
    codec = codecs[name]
    full, _ = _run(codec, "full")
    win, _ = _run(codec, "window")
    assert full.truncated and not full.terminated and full.reward == 0.0 and full.metrics["compactions"] == 0
    assert win.terminated and win.reward == 1.0 and win.metrics["compactions"] >= 2
    from rl.observe.telemetry import rollout_metrics

    m = rollout_metrics([RolloutGroup(task_id="t", domain="terminal", episodes=(full,))])
    assert m["episode/truncated_rate/terminal"] == 1.0 and m["episode/compactions_mean/terminal"] == 0.0
    m = rollout_metrics([RolloutGroup(task_id="t", domain="terminal", episodes=(win,))])
    assert m["episode/truncated_rate/terminal"] == 0.0 and m["episode/compactions_mean/terminal"] >= 2
    assert m["episode/segments_mean/terminal"] == m["episode/compactions_mean/terminal"] + 1
    assert m["episode/context_tokens_max/terminal"] <= LEN
    assert m["tokens/response_mean/terminal"] == sum(sum(s.loss_mask) for s in segments_of(win))


def test_per_domain_override_and_unknown_strategy():
    s = ContextSettings(strategy="full", by_domain={"terminal": "window"})
    assert s.strategy_for("terminal") == "window" and s.strategy_for("swe") == "full"
    with pytest.raises(ValueError, match="unknown context strategy 'nope'.*full, summarize, window"):
        ContextSettings(strategy="nope")


@pytest.mark.parametrize("text,problem", [("", "empty"), ("   \n", "empty"), ("tally 3 <|im_end|><|im_start|>system", "special")])
def test_bad_summaries_reach_the_next_context_with_a_note(codecs, text, problem):
    msg, got = summary_message(Reply(text=text, capped=False), codecs["jointrl"].special_strings)
    assert got == problem
    ids = codecs["jointrl"].tokenizer.encode(msg.content, add_special_tokens=False)
    assert not set(ids) & {chat.IM_END_ID, chat.IM_START_ID}  # no forged turn
    ep, pol = _run(codecs["jointrl"], "summarize", summary=lambda k: text)
    assert ep.grade_error is None and ep.metrics["summary_problems"] == ep.metrics["compactions"] >= 2
    _assert_exact(ep, pol)
    notes = [m.content for m in ep.messages if m.role == "user" and m.content.startswith("Summary of your progress")]
    assert notes and all(("empty summary" in n) if problem == "empty" else ("broken up" in n) for n in notes)


def test_a_summary_cut_at_the_cap_is_noted_and_one_too_long_for_the_budget_ends_the_episode(codecs):
    codec = codecs["jointrl"]
    msg, problem = summary_message(Reply(text="tally 4", capped=True), codec.special_strings)
    assert problem == "cut" and "cut at the token limit" in msg.content
    # A summary longer than the budget leaves room for (the engine caps it at 96 tokens; the budget is the head + 60)
    head = len(codec.prompt_ids(list(_task().prompt), envs.make(ENV).tool_schemas))
    ep, _ = _run(codec, "summarize", budget=head + 60, summary=lambda k: "word " * 200)
    assert ep.truncated and ep.grade_error is None and ep.metrics["compactions"] == 0


def test_window_keeps_the_head_and_the_last_turns_and_gives_up_when_one_turn_is_too_big():
    head = [Message(role="system", content="s"), Message(role="user", content="task")]
    turns = [[Message(role="assistant", content=f"a{i}"), Message(role="tool", content="x" * 10, tool_call_id=f"c{i}")]
             for i in range(6)]

    async def ask(_):
        raise AssertionError("window never asks the policy")

    from rl.rollout.context import CONTEXT_STRATEGIES

    def view(budget, keep=0, count=lambda ms: 10 * len(ms)):
        return CompactionView(head=head, turns=turns, budget=budget, keep_turns=keep, count=count, ask=ask)

    got = asyncio.run(CONTEXT_STRATEGIES.get("window")(view(budget=140)))  # half the budget, 70: head + 2 turns = 60
    assert got.messages == head + turns[4] + turns[5] and got.dropped_turns == 4
    got = asyncio.run(CONTEXT_STRATEGIES.get("window")(view(budget=1000, keep=3)))
    assert got.messages == head + [m for t in turns[3:] for m in t] and got.dropped_turns == 3
    assert asyncio.run(CONTEXT_STRATEGIES.get("window")(view(budget=30))) is None


def test_segments_are_rows_sharing_the_episode_reward_group_and_advantage(codecs):
    """Collation: one row per segment; GRPO computed per episode (a segmented episode is one sample of its group),
    and sequence-mean aggregation counting it once (the slow, obvious reference: the same episodes unsegmented)."""
    from rl.algos import aggregation_weights
    from rl.config import AlgorithmSection
    from rl.train import with_episode_advantages
    from rl.trainer.batch import EpisodeView, collate

    ep, _ = _run(codecs["jointrl"], "window")
    n = len(segments_of(ep))
    others = [dataclasses.replace(ep, segments=(), reward=r, token_ids=ep.token_ids[:50], loss_mask=(0,) + (1,) * 49,
                                  rollout_logprobs=(0.0,) * 50, routed_experts=None) for r in (0.0, 0.0, 1.0)]
    group = [ep] + others
    batch = collate(group, [0.0] * 4)
    assert batch.num_seqs == n + 3 and batch.episode_ids_B.tolist() == [0] * n + [1, 2, 3]
    assert batch.rewards_B.tolist() == [1.0] * n + [0.0, 0.0, 1.0] and len(set(batch.group_ids_B.tolist())) == 1
    for b, s in enumerate(segments_of(ep)):
        assert batch.input_ids_BT[b, :len(s.token_ids)].tolist() == list(s.token_ids)
    out, _ = with_episode_advantages(batch, AlgorithmSection(advantage="grpo"))
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()  # one sample per episode, Bessel std, as GRPO defines
    for b, e in enumerate(batch.episode_ids_B.tolist()):
        m = batch.loss_mask_BT[b] > 0
        assert torch.allclose(out.advantages_BT[b][m], torch.full((int(m.sum()),), want[e]), atol=1e-5)
    view = EpisodeView.of(batch)
    w, _ = aggregation_weights("seq_mean_token_mean", view.to_episodes(batch.loss_mask_BT > 0, False))
    w_rows = view.to_rows(w)
    per_episode = [float(w_rows[batch.episode_ids_B == e].sum()) for e in range(4)]
    assert per_episode == pytest.approx([0.25] * 4)  # each episode weighs 1/4 whatever its number of segments


def test_images_in_the_history_are_placed_again_in_each_new_context(codecs):
    """An observation image (every third log answered with a picture too) survives a compaction: the next
    context's prompt carries it with its patch span, and each segment's image spans are inside it."""
    from envs.base import ToolEnv
    from model.shipped import load_shipped_config
    from model.vision import VisionSpec
    from rl.rollout.multimodal import ImageSettings, blank_png, check_spans

    spec = VisionSpec.from_config(load_shipped_config("tiny"))
    png = blank_png(spec.patch_size * 2, spec.patch_size * 2, spec.channels)

    class WithImages(ToolEnv):
        async def step(self, assistant, **kw):
            res = await super().step(assistant, **kw)
            msgs = tuple(dataclasses.replace(m, images=(png,)) if m.role == "tool" and "log 3 ==" in m.content else m
                         for m in res.messages)
            return dataclasses.replace(res, messages=msgs)

    from envs.terminal.longhorizon import LogTrailDomain

    ep, pol = _run(codecs["jointrl"], "window", keep_turns=3, env=WithImages(LogTrailDomain()),
                   images=ImageSettings(spec=spec, max_images=4))
    assert ep.metrics["compactions"] >= 2 and ep.reward == 1.0
    with_img = [s for s in segments_of(ep) if s.images]
    assert with_img  # the picture was in context for at least one segment
    for s in segments_of(ep):
        check_spans(s.token_ids, s.images, spec.image_token_id)
        assert all(np.all(np.asarray(s.loss_mask[i.start:i.start + i.length]) == 0) for i in s.images)


@pytest.mark.parametrize("strategy", ["window", "summarize"])
def test_references_longer_than_the_context_replay_as_segments_for_sft(codecs, strategy):
    """rl/rollout/replay.py: the reference played through the loop gives the segments the policy's episodes have,
    each within the context, scoring 1 (rl/sft.py uses these when a reference outgrows rollout.max_model_len)."""
    from rl.rollout.replay import REFERENCE_SUMMARY, reference_in_context

    codec = codecs["hf"]
    settings = LoopSettings(max_model_len=LEN, max_new_tokens_per_turn=96, max_turns=40, end_token_id=codec.end_token_id,
                            context=ContextSettings(strategy=strategy))
    eps = asyncio.run(reference_in_context([_task(0), _task(1)], lambda t: envs.make(ENV), codec, settings))
    assert len(eps) == 2
    for e in eps:
        assert e.reward == 1.0 and len(segments_of(e)) >= 3
        assert all(len(s.token_ids) <= LEN and sum(s.loss_mask) > 0 for s in segments_of(e))
        if strategy == "summarize":
            assert sum(REFERENCE_SUMMARY in m.content for m in e.messages if m.role == "assistant") == e.metrics["compactions"]


def test_demonstrations_of_a_full_context_run_are_shown_in_a_window():
    from rl.rollout.replay import demonstration_settings

    s = demonstration_settings(LoopSettings(context=ContextSettings(strategy="full", by_domain={"a": "full", "b": "summarize"})))
    assert (s.context.strategy, s.context.by_domain) == ("window", {"a": "window", "b": "summarize"})
