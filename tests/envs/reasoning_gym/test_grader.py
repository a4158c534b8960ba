"""The reasoning-gym grader against reasoning-gym's own `score_answer` (run here, in the test process, as
the oracle): reference answers score 1 and corrupted answers score what `score_answer` gives (< 1), on
every domain; the same through the Env API in both answer modes, under the project's rules for the
scorers it does not trust (`envs/reasoning_gym/answers.py`). Starts the judge process (slow, ~40 s,
most of it generating one task per domain)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("reasoning_gym")

import envs  # noqa: E402
from envs.reasoning_gym.catalog import datasets  # noqa: E402
from envs.reasoning_gym.judge import ItemRef, Judge  # noqa: E402
from jointrl.records import Message  # noqa: E402
from tests.envs.reasoning_gym.helpers import corruptions, oracle, project_oracle, stratified_sample  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judge():
    j = Judge()
    yield j
    j.close()


def ref_of(t) -> ItemRef:
    p = t.private
    return ItemRef(p["dataset"], int(p["seed"]), int(p["size"]), p["entry"])


def test_judge_agrees_with_score_answer_on_every_domain(judge):
    no_wrong = []
    for info in datasets():
        t = envs.generate_tasks(info.env_id, "train", 0, 1)[0]
        ref = t.private["reference"]
        assert oracle(t, ref) == 1.0, info.name
        v = judge.score(ref_of(t), ref)
        assert (v.score, v.outcome) == (1.0, "scored"), (info.name, v)
        wrong = [c for c in corruptions(ref) if (oracle(t, c) or 0.0) < 1.0]
        if not wrong:
            no_wrong.append(info.name)
            continue
        want = oracle(t, wrong[0])
        v = judge.score(ref_of(t), wrong[0])
        if want is None:  # the scorer raises on this answer
            assert (v.outcome, v.score) == ("scorer_error", 0.0), (info.name, wrong[0], v)
        else:
            assert v.outcome == "scored" and v.score == pytest.approx(want, abs=1e-9), (info.name, wrong[0], v)
        assert v.score < 1.0
    assert not no_wrong, f"no corruption scored < 1 for {no_wrong}"


def _episode(env_id: str, task, message: Message, **kw):
    async def go():
        env = envs.make(env_id, **kw)
        try:
            await env.reset(task)
            res = await env.step(message)
            return res, await env.grade()
        finally:
            env.close()
    return asyncio.run(go())


def _answer_call(text: str) -> Message:
    from envs.base import ToolInvocation, messages_for_calls

    return messages_for_calls([ToolInvocation("answer", {"text": text})])[0]


@pytest.mark.parametrize("final_message", [False, True], ids=["answer-tool", "final-message"])
def test_env_rewards_equal_score_answer(final_message):
    for info in stratified_sample(12):
        t = envs.generate_tasks(info.env_id, "train", 0, 1)[0]
        ref = t.private["reference"]
        wrong = next(c for c in corruptions(ref) if (oracle(t, c) or 0.0) < 1.0)
        for answer, want in ((ref, 1.0), (wrong, project_oracle(t, wrong))):
            msg = Message(role="assistant", content=f"Let me think.\n<answer>{answer}</answer>") if final_message \
                else _answer_call(answer)
            res, g = _episode(info.env_id, t, msg, final_message=final_message)
            assert res.terminated and g.error is None, (info.name, g.error)
            assert g.reward == pytest.approx(want, abs=1e-9), (info.name, answer, g.reward, want)
            assert g.metrics["check/answered"] == 1.0
