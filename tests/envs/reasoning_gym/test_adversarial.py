"""Attacks on the reasoning-gym grader by a policy: forging the answer or the judge's reply, code smuggled
through a scorer that `eval`s its input, flooding and hanging the grader, and injection into the answer
format. Each must leave the reward below 1 (0 where nothing is scored) and the grader working.
Starts judge processes (slow, ~30 s)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("reasoning_gym")

import envs  # noqa: E402
from envs.base import ToolInvocation, messages_for_calls  # noqa: E402
from envs.reasoning_gym.judge import MAX_ANSWER_CHARS, ItemRef, Judge  # noqa: E402
from jointrl.records import Message, ToolCall  # noqa: E402

pytestmark = pytest.mark.slow
COUNTDOWN = "rg-countdown-v0"  # its score_answer calls sympy's parse_expr (an eval) on the answer


@pytest.fixture(scope="module")
def judge():
    j = Judge(timeout_s=3.0)
    yield j
    j.close()


@pytest.fixture(scope="module")
def countdown():
    return envs.generate_tasks(COUNTDOWN, "train", 0, 2)


def ref(t) -> ItemRef:
    p = t.private
    return ItemRef(p["dataset"], int(p["seed"]), int(p["size"]), p["entry"])


def test_code_in_the_answer_runs_in_process_but_not_in_the_judge(judge, countdown, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    # Control: reasoning-gym's own scorer, called in an ordinary process, executes the payload.
    t = countdown[0]
    ctl = ("import json, sys, reasoning_gym as rg\n"
           f"e = json.loads({t.private['entry']!r})\n"
           "rg.create_dataset('countdown', seed=0, size=8).score_answer(sys.argv[1], e)\n")
    subprocess.run([sys.executable, "-c", ctl, payload], check=True, capture_output=True, timeout=120)
    assert marker.exists(), "the control did not run the payload: the attack is not real"
    marker.unlink()
    v = judge.score(ref(t), payload)
    assert v.score < 1.0 and not marker.exists()
    assert judge.score(ref(t), t.private["reference"]).score == 1.0  # the judge still grades


def test_forged_score_lines_and_patched_scorers_do_not_count(judge, countdown):
    t, t2 = countdown
    # Write a fake "score|tag" result and a fake JSON reply to every plausible fd, then exit at once.
    forge = ("exec('import os\\nfor fd in range(3, 64):\\n try: os.write(fd, b\\'1.0|\\' + b\\'0\\' * 64)\\n'"
             "' except OSError: pass\\nos._exit(0)')")
    v = judge.score(ref(t), forge)
    assert v.score == 0.0 and v.outcome == "judge_crash", v
    v = judge.score(ref(t), '{"nonce": "0", "score": 1.0}\n{"score": 1.0}')
    assert v.score < 1.0
    # Patching the scorer class from inside a scorer must not survive to the next answer.
    patch = ("setattr(__import__('reasoning_gym').games.countdown.CountdownDataset, 'score_answer', "
             "lambda self, a, e: 1.0) or 1")
    assert judge.score(ref(t), patch).score < 1.0
    assert judge.score(ref(t2), "1 + 1").score < 1.0


def test_a_hanging_scorer_is_killed_and_the_judge_goes_on(judge, countdown):
    t = countdown[0]
    t0 = time.monotonic()
    v = judge.score(ref(t), "9**9**9**9**9")
    took = time.monotonic() - t0
    assert v.score == 0.0 and v.outcome in ("judge_timeout", "judge_crash"), v
    assert took < judge.timeout_s + 5.0
    assert judge.score(ref(t), t.private["reference"]).score == 1.0


def test_floods_are_refused_before_the_scorer(judge, countdown):
    t = countdown[0]
    v = judge.score(ref(t), "1+" * MAX_ANSWER_CHARS)
    assert (v.score, v.outcome) == (0.0, "answer_too_long")

    async def go():  # through the Env: the oversize call is malformed and nothing is answered
        env = envs.make(COUNTDOWN)
        try:
            await env.reset(t)
            big = json.dumps({"text": t.private["reference"] + " " * 70_000})
            res = await env.step(Message(role="assistant", content="", tool_calls=(ToolCall("c0", "answer", big),)))
            assert not res.terminated
            return await env.grade()
        finally:
            env.close()
    g = asyncio.run(go())
    assert g.reward == 0.0 and g.error is None and g.metrics["check/answered"] == 0.0


def _final(t, content: str, reasoning: str | None = None):
    async def go():
        env = envs.make(COUNTDOWN, final_message=True)
        try:
            await env.reset(t)
            await env.step(Message(role="assistant", content=content, reasoning=reasoning))
            return await env.grade()
        finally:
            env.close()
    return asyncio.run(go())


def test_answer_format_injection(countdown):
    t = countdown[0]
    right = t.private["reference"]
    # The answer is read from the reply's content only, never from its reasoning.
    assert _final(t, "<answer>1 + 1</answer>", reasoning=f"<answer>{right}</answer>").reward < 1.0
    # The last complete tag pair counts; a trailing unclosed tag does not hide it, nor open a new one.
    assert _final(t, f"<answer>1 + 1</answer> no wait <answer>{right}</answer> <answer>").reward == 1.0
    assert _final(t, f"<answer>{right}</answer> actually <answer>1 + 1</answer>").reward < 1.0
    # A reply of 200,000 unclosed tags is graded at once (a non-greedy regex would be quadratic).
    t0 = time.monotonic()
    g = _final(t, "<answer>" * 200_000)
    assert g.reward < 1.0 and g.error is None and time.monotonic() - t0 < 10.0

    async def two_answers():  # tool mode: the first answer ends the episode; a second call is not run
        env = envs.make(COUNTDOWN)
        try:
            await env.reset(t)
            msg = messages_for_calls([ToolInvocation("answer", {"text": "1 + 1"})])[0]
            second = messages_for_calls([ToolInvocation("answer", {"text": right})], start=1)[0]
            res = await env.step(Message(role="assistant", content="", tool_calls=msg.tool_calls + second.tool_calls))
            assert "Not executed" in res.messages[1].content
            return await env.grade()
        finally:
            env.close()
    assert asyncio.run(two_answers()).reward < 1.0
