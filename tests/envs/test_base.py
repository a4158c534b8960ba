"""The framework (ToolEnv): budgets, malformed output, grading failures, API order; with a pure-Python domain."""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Mapping

import pytest

from envs.base import Domain, EnvSetupError, EnvUsageError, ToolEnv, ToolInvocation, clip_observation, messages_for_calls
from envs.play import ScriptedPolicy, run_episode
from envs.tools import ToolArgError, ToolContext, tool
from jointrl.records import Limits, Message, Task, ToolCall
from rewards import Rubric, Term, check, malformed_fraction


class Counter(Domain):
    """Reach `target` by adding numbers. Tools cover every framework path."""

    rubric = Rubric((Term("correct", check("correct"), 1.0), Term("malformed", malformed_fraction, -0.1)),
                    truncated_reward=-0.25, error_reward=-1.0)

    def __init__(self, check_mode: str = "ok", fail_setup: bool = False) -> None:
        self.total = 0
        self.check_mode = check_mode
        self.fail_setup = fail_setup
        self.teardowns = 0
        self.before_grade_calls = 0
        self.seen_ctx: list[ToolContext] = []

    def setup(self, task: Task) -> None:
        if self.fail_setup:
            raise OSError("no sandbox today")
        self.total = 0

    @tool
    def add(self, n: int, ctx: ToolContext) -> str:
        """Add a number to the total.

        Args:
            n: how much to add (non-negative)
        """
        if n < 0:
            raise ToolArgError("n must be non-negative")
        self.seen_ctx.append(ctx)
        self.total += n
        return f"total={self.total}"

    @tool
    def echo(self, text: str) -> str:
        """Echo text back.

        Args:
            text: what to echo
        """
        return text

    @tool
    def slow(self, seconds: float) -> str:
        """Block for a while (a synchronous tool).

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "slept"

    @tool
    async def aslow(self, seconds: float) -> str:
        """Wait for a while (an async tool).

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        return "waited"

    @tool
    def boom(self) -> str:
        """Fail."""
        raise RuntimeError("kaput")

    @tool
    def stats(self) -> dict:
        """Return a structure."""
        return {"total": self.total}

    @tool(ends_episode=True)
    def finish(self) -> str:
        """Finish the episode."""
        return "done"

    def before_grade(self) -> None:
        self.before_grade_calls += 1

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        if self.check_mode == "raise":
            raise ValueError("grader bug")
        if self.check_mode == "hang":
            time.sleep(3)
        return {"correct": float(self.total == task.private["target"])}

    def teardown(self) -> None:
        self.teardowns += 1

    def reference(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("add", {"n": task.private["target"]}), ToolInvocation("finish")]


def make_task(target: int = 5, **limits) -> Task:
    return Task(id=f"c{target}", domain="counter", prompt=(Message(role="user", content=f"reach {target}"),),
                private={"target": target}, limits=Limits(**{"max_turns": 6, "tool_timeout_s": 1.0, **limits}))


def call(name: str, args: str | dict = "{}", cid: str = "c1") -> Message:
    raw = args if isinstance(args, str) else json.dumps(args)
    return Message(role="assistant", tool_calls=(ToolCall(id=cid, name=name, arguments=raw),))


def run(coro):
    return asyncio.run(coro)


def episode(domain: Counter, task: Task, msgs: list[Message], **env_kw):
    async def go():
        env = ToolEnv(domain, **env_kw)
        prompt, tools = await env.reset(task)
        results = [await env.step(m) for m in msgs]
        g = await env.grade()
        env.close()
        return env, results, g
    return run(go())


# ----------------------------------------------------------------------------- happy path and API
def test_reference_scores_one_and_noop_scores_zero():
    d = Counter()
    env, res, g = episode(d, make_task(), messages_for_calls(d.reference(make_task())))
    assert res[-1].terminated and not res[-1].truncated and g.reward == 1.0 and g.error is None
    assert g.metrics["turns"] == 2 and g.metrics["malformed_calls"] == 0 and d.before_grade_calls == 1
    d2 = Counter()
    _, res, g = episode(d2, make_task(), messages_for_calls(d2.noop(make_task())))
    assert res[-1].terminated and g.reward == 0.0


def test_reset_returns_prompt_and_schemas_and_tools_get_context():
    d = Counter()
    env = ToolEnv(d)
    msgs, tools = run(env.reset(make_task(tool_timeout_s=0.75)))
    assert msgs == [Message(role="user", content="reach 5")]
    names = [t["function"]["name"] for t in tools]
    assert names == ["add", "echo", "slow", "aslow", "boom", "stats", "finish"]
    assert "ctx" not in tools[0]["function"]["parameters"]["properties"]
    run(env.step(call("add", {"n": 2})))
    assert d.seen_ctx[0].timeout_s == pytest.approx(0.75) and d.seen_ctx[0].turn == 1 and d.seen_ctx[0].task.id == "c5"
    env.close()


def test_api_order_misuse_raises_usage_errors():
    env = ToolEnv(Counter())
    with pytest.raises(EnvUsageError):
        run(env.step(call("finish")))
    with pytest.raises(EnvUsageError):
        run(env.grade())
    with pytest.raises(EnvUsageError, match="Task"):
        run(env.reset({"id": "x"}))
    env.close()
    with pytest.raises(EnvUsageError, match="closed"):
        run(env.reset(make_task()))


def test_setup_failure_is_an_env_setup_error_and_tears_down():
    d = Counter(fail_setup=True)
    with pytest.raises(EnvSetupError, match="no sandbox today"):
        run(ToolEnv(d).reset(make_task()))
    assert d.teardowns >= 1


def test_close_is_idempotent_and_step_after_close_does_not_raise():
    d = Counter()
    env = ToolEnv(d)

    async def go():
        await env.reset(make_task())
        env.close()
        env.close()
        res = await env.step(call("add", {"n": 1}))
        g = await env.grade()
        return res, g
    res, g = run(go())
    assert d.teardowns == 1
    assert res.truncated and res.messages == () and "over" in res.info["error"]
    assert g.error and "close" in g.error and g.metrics["grade_error"] == 1.0


def test_step_after_the_end_returns_nothing_and_grade_is_cached():
    async def go():
        env = ToolEnv(Counter())
        await env.reset(make_task())
        await env.step(call("finish"))
        again = await env.step(call("add", {"n": 5}))
        g1, g2 = await env.grade(), await env.grade()
        env.close()
        return again, g1, g2
    again, g1, g2 = run(go())
    assert again.messages == () and again.terminated and g1 is g2


# ----------------------------------------------------------------------------- budgets
def test_max_turns_truncates_with_the_fixed_reward():
    d = Counter()
    msgs = [call("add", {"n": 1}, cid=f"c{i}") for i in range(10)]
    env, res, g = episode(d, make_task(target=3, max_turns=3), msgs)
    assert [r.truncated for r in res[:3]] == [False, False, True]
    assert res[2].info["truncation_reason"] == "max_turns" and res[3].messages == ()
    assert g.reward == -0.25 and g.metrics["truncated"] == 1.0 and g.metrics["turns"] == 3
    assert g.metrics["check/correct"] == 1.0  # solved but not submitted: logged, still the fixed reward


def test_finishing_on_the_last_turn_is_terminated_not_truncated():
    d = Counter()
    _, res, g = episode(d, make_task(target=1, max_turns=2), [call("add", {"n": 1}), call("finish")])
    assert res[-1].terminated and not res[-1].truncated and g.reward == 1.0


@pytest.mark.parametrize("tool_name", ["slow", "aslow"])
def test_per_tool_timeout_answers_the_model_and_the_episode_goes_on(tool_name):
    d = Counter()
    t0 = time.monotonic()
    _, res, g = episode(d, make_task(target=2, tool_timeout_s=0.3), [call(tool_name, {"seconds": 30}),
                                                                  call("add", {"n": 2}), call("finish")], grace_s=0.2)
    assert time.monotonic() - t0 < 5
    assert "did not finish within its 0.3 s" in res[0].messages[0].content and not res[0].truncated
    assert g.reward == 1.0 and g.metrics["tool_timeouts"] == 1


def test_episode_wall_time_truncates_and_stops_running_tools():
    d = Counter()
    t0 = time.monotonic()
    msgs = [call("aslow", {"seconds": 0.2}, cid=f"w{i}") for i in range(5)] + [call("finish")]
    _, res, g = episode(d, make_task(episode_timeout_s=0.5, tool_timeout_s=5, max_turns=20), msgs)
    assert time.monotonic() - t0 < 3
    ended = next(i for i, r in enumerate(res) if r.truncated)
    assert res[ended].info["truncation_reason"] == "episode_timeout" and ended <= 3
    assert g.reward == -0.25


def test_time_between_steps_is_the_policy_s_and_does_not_count():
    # The policy takes 0.4 s to "generate" before each of three calls under a 0.5 s episode budget: the
    # episode is not truncated (1.2 s of wall time, ~0 s of environment time) and grades 1.
    d = Counter()

    async def go():
        env = ToolEnv(d)
        await env.reset(make_task(target=2, episode_timeout_s=0.5, max_turns=20))
        out = []
        for m in [call("add", {"n": 1}), call("add", {"n": 1}), call("finish")]:
            await asyncio.sleep(0.4)
            out.append(await env.step(m))
        g = await env.grade()
        env.close()
        return out, g

    res, g = run(go())
    assert not any(r.truncated for r in res) and res[-1].terminated
    assert res[-1].info["elapsed_s"] >= 1.2 > 0.5 > res[-1].info["env_s"]
    assert g.reward == 1.0


def test_a_tool_call_cannot_outlive_the_episode_budget():
    d = Counter()
    _, res, _ = episode(d, make_task(episode_timeout_s=0.4, tool_timeout_s=10), [call("aslow", {"seconds": 5})])
    assert "did not finish within its 0.4 s" in res[0].messages[0].content or "0.3 s" in res[0].messages[0].content
    assert res[0].truncated


def _clip_reference(text: str, max_chars: int) -> str:
    """Obvious version: try every dropped count until head + marker + tail fits exactly."""
    if len(text) <= max_chars:
        return text
    for dropped in range(len(text) - max_chars, len(text) + 1):
        marker = f"\n[... {dropped} characters clipped ...]\n"
        keep = len(text) - dropped
        if keep + len(marker) == max_chars:
            head = keep - keep // 2
            return text[:head] + marker + text[len(text) - keep // 2:] if keep // 2 else text[:head] + marker
    return text[:max_chars]


def test_clip_observation_matches_reference():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.choice([0, 5, 50, 99, 100, 101, 1000, 12345])
        text = "".join(rng.choice("ab\n") for _ in range(n))
        m = rng.choice([0, 10, 30, 40, 45, 60, 100, 500])
        out, clipped = clip_observation(text, m)
        assert out == _clip_reference(text, m), (n, m)
        assert len(out) <= m or not clipped
        assert clipped == (len(text) > m)


def test_observations_are_clipped_head_and_tail():
    d = Counter()
    text = "HEAD" + "x" * 5000 + "TAIL"
    _, res, g = episode(d, make_task(max_obs_chars=100), [call("echo", {"text": text})])
    out = res[0].messages[0].content
    assert len(out) == 100 and out.startswith("HEAD") and out.endswith("TAIL") and "characters clipped" in out
    assert g.metrics["obs_clipped"] == 1


# ----------------------------------------------------------------------------- malformed output
@pytest.mark.parametrize("msg, expect", [
    (Message(role="assistant", content="I would add five."), "no tool call"),
    (call("add", '{"n": 5'), "not valid JSON"),
    (call("add", '"5"'), "must be a JSON object"),
    (call("add", '{"n": "five"}'), "must be integer, got string"),
    (call("add", '{"n": 5, "m": 1}'), "unexpected argument(s) m"),
    (call("add", "{}"), "missing required argument(s): n"),
    (call("add", {"n": -1}), "n must be non-negative"),
    (call("rm_rf", "{}"), "unknown tool 'rm_rf'"),
    (call("echo", {"text": "x" * 2_000_000}), "the limit is 1000"),
])
def test_malformed_output_becomes_an_error_message_and_the_episode_goes_on(msg, expect):
    d = Counter()
    _, res, g = episode(d, make_task(target=5, max_arg_chars=1000), [msg, call("add", {"n": 5}, "c2"), call("finish", cid="c3")])
    first = res[0]
    assert not first.terminated and not first.truncated and len(first.messages) == 1
    reply = first.messages[0]
    assert expect in reply.content and reply.content.startswith("Error")
    if msg.tool_calls:
        assert reply.role == "tool" and reply.tool_call_id == msg.tool_calls[0].id
    else:
        assert reply.role == "user" and "finish" in reply.content
    assert g.metrics["malformed_calls"] == 1 and g.metrics["tool_calls"] == (2 + bool(msg.tool_calls))
    assert g.reward == pytest.approx(1.0 - 0.1 * g.metrics["malformed_calls"] / g.metrics["tool_calls"])


def test_tool_exceptions_and_non_string_results():
    d = Counter()
    _, res, g = episode(d, make_task(), [call("boom"), call("stats")])
    assert "tool 'boom' failed: RuntimeError: kaput" in res[0].messages[0].content
    assert json.loads(res[1].messages[0].content) == {"total": 0}
    assert g.metrics["tool_errors"] == 1 and g.metrics["malformed_calls"] == 0


def test_many_calls_in_one_turn_are_capped_and_nothing_runs_after_finish():
    d = Counter()
    calls = tuple(ToolCall(id=f"k{i}", name="add", arguments='{"n": 1}') for i in range(5))
    _, res, g = episode(d, make_task(target=3), [Message(role="assistant", tool_calls=calls)], max_calls_per_turn=3)
    contents = [m.content for m in res[0].messages]
    assert [m.tool_call_id for m in res[0].messages] == [f"k{i}" for i in range(5)]
    assert contents[:3] == ["total=1", "total=2", "total=3"] and all("skipped" in c for c in contents[3:])
    d2 = Counter()
    both = (ToolCall(id="a", name="finish", arguments="{}"), ToolCall(id="b", name="add", arguments='{"n": 5}'))
    _, res, g = episode(d2, make_task(target=5), [Message(role="assistant", tool_calls=both)])
    assert res[0].terminated and "Not executed" in res[0].messages[1].content and g.reward == 0.0


def test_text_can_end_the_episode_when_the_domain_says_so():
    class Answer(Counter):
        text_ends_episode = True

    _, res, g = episode(Answer(), make_task(), [Message(role="assistant", content="the answer is 5")])
    assert res[0].terminated and res[0].messages == () and g.metrics["malformed_calls"] == 0


# ----------------------------------------------------------------------------- grading failures
def test_grader_exception_is_a_visible_error_grade_not_a_raise():
    _, _, g = episode(Counter(check_mode="raise"), make_task(), [call("finish")])
    assert g.reward == -1.0 and g.metrics["grade_error"] == 1.0 and "ValueError: grader bug" in g.error


def test_grader_timeout_is_a_visible_error_grade():
    t0 = time.monotonic()
    _, _, g = episode(Counter(check_mode="hang"), make_task(), [call("finish")], grade_timeout_s=0.3)
    assert time.monotonic() - t0 < 2.5
    assert g.reward == -1.0 and "timed out" in g.error


def test_grade_of_a_running_episode_truncates_it():
    async def go():
        env = ToolEnv(Counter())
        await env.reset(make_task(target=1))
        await env.step(call("add", {"n": 1}))
        g = await env.grade()
        env.close()
        return g
    g = run(go())
    assert g.metrics["truncated"] == 1.0 and g.reward == -0.25


def test_concurrent_episodes_on_one_loop_do_not_serialise():
    async def one(i):
        env = ToolEnv(Counter())
        tr = await run_episode(env, make_task(target=0), ScriptedPolicy([ToolInvocation("slow", {"seconds": 0.3}),
                                                                          ToolInvocation("finish")]))
        env.close()
        return tr.grade.reward

    async def go():
        return await asyncio.gather(*(one(i) for i in range(16)))
    t0 = time.monotonic()
    rewards = run(go())
    assert rewards == [1.0] * 16 and time.monotonic() - t0 < 2.0  # serial would take 4.8 s
