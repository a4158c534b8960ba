"""Failure isolation in the agent loop: pathological tool calls, and episodes that raise, inside a batch.

The engine double replays a script per episode, chosen by the request's seed (the loop derives each
request's seed from the episode's position, so the double knows which episode asks). The first test
runs the real terminal environment in its bubblewrap sandbox with the shipped tokenizer and chat codec;
the others use a pure-Python domain so that failures can be injected where a real domain has none.
What is not covered here: a real vLLM engine (tests/rl/rollout/test_engine_*.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping

import pytest

import model.chat as chat
from envs.base import Domain, ToolEnv
from envs.tools import tool
from jointrl.records import Limits, Message, Task, ToolCall
from rewards import Rubric, Term, check
from rl.rollout.agent_loop import (BatchingGenerator, EngineFailure, LoopSettings, episode_seed, run_groups,
                                   turn_seed)
from rl.rollout.engine import GenerateResult

DEEP = "[" * 1200 + "]" * 1200
HUGE = "7" * 19_000


@pytest.fixture(scope="module")
def tok():
    return chat.load_tokenizer()


def _call(name: str, args: dict) -> Message:
    return Message(role="assistant", content="", tool_calls=(ToolCall(id="c", name=name, arguments=json.dumps(args)),))


def _raw_call(name: str, arguments_text: str) -> str:
    """A generated turn whose one tool call carries `arguments_text` verbatim (no JSON validation)."""
    return (f"\n\n</think>\n\n<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {arguments_text}}}\n</tool_call>"
            f"{chat.IM_END_TOKEN}")


class SeededScriptEngine:
    """Turn k of episode (task i, sample g) gets `scripts[(i, g)][k]` (the last entry repeats)."""

    def __init__(self, tok, scripts: Mapping[tuple[int, int], list[Message | str]], base_seed: int = 0,
                 max_turns: int = 16, fail: bool = False):
        self.tok = tok
        self.scripts = scripts
        self.fail = fail
        self.by_seed = {turn_seed(episode_seed(base_seed, i, g), k): (i, g, k)
                        for (i, g) in scripts for k in range(max_turns)}

    async def __call__(self, reqs):
        if self.fail:
            raise ConnectionError("engine worker died")
        out = []
        for r in reqs:
            i, g, k = self.by_seed[r.seed]
            script = self.scripts[(i, g)]
            t = script[min(k, len(script) - 1)]
            text = chat.render_completion(t) if isinstance(t, Message) else t
            ids = self.tok.encode(text, add_special_tokens=False)[: r.max_tokens]
            out.append(GenerateResult(token_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids), finish_reason="stop"))
        return out


def _settings(**kw) -> LoopSettings:
    base = dict(max_model_len=32_768, max_new_tokens_per_turn=24_000, max_turns=4, end_token_id=chat.IM_END_ID)
    return LoopSettings(**{**base, **kw})


def _observations(ep) -> str:
    return "\n".join(m.content for m in ep.messages if m.role in ("tool", "user"))


def test_pathological_tool_calls_in_a_terminal_batch_are_malformed_calls_and_the_rest_is_intact(tok):
    envs = pytest.importorskip("envs")
    tasks = [Task.from_row(r) for r in envs.tasks("terminal-v0", "train", seed=0, n=3)]
    env0 = envs.make("terminal-v0")
    reference = [_call(c.name, dict(c.arguments)) for c in env0.reference(tasks[0])]
    env0.close()
    honest = [_call("bash", {"command": "ls"}), _call("submit", {})]
    scripts: dict[tuple[int, int], list[Message | str]] = {
        (0, 0): reference, (0, 1): reference,
        (1, 0): [_raw_call("bash", '{"command": ' + DEEP + "}"), _call("submit", {})],   # ~1,200 levels deep
        (1, 1): [_raw_call("bash", '{"command": ' + HUGE + "}"), _call("submit", {})],   # a 19,000-digit number
        (2, 0): honest, (2, 1): honest,
    }
    eng = SeededScriptEngine(tok, scripts)
    groups = asyncio.run(run_groups(tasks, 2, lambda t: envs.make("terminal-v0"), BatchingGenerator(eng), tok, chat,
                                    _settings()))
    assert [len(g) for g in groups] == [2, 2, 2]
    # The reference episodes score 1, untouched by their neighbours' failures.
    assert [e.reward for e in groups[0]] == [1.0, 1.0] and all(e.grade_error is None for e in groups[0])
    # The pathological calls were answered as malformed calls, and the episodes went on to submit.
    deep, huge = groups[1]
    for ep, what in ((deep, "nested deeper than"), (huge, "digits")):
        assert ep.grade_error is None and ep.metrics["episode_error"] == 0.0
        assert ep.terminated and ep.num_turns == 2
        assert ep.metrics["malformed_calls"] >= 1 and ep.metrics["parse_errors"] >= 1
        assert what in _observations(ep)
        assert ep.reward < 1.0
    assert all(e.grade_error is None and e.terminated and e.num_turns == 2 for e in groups[2])


# ----------------------------------------------------------------------------- a pure-Python domain
class Tally(Domain):
    """Add numbers; `submit` ends. `raise_in` names a hook that raises (to inject failures)."""

    rubric = Rubric((Term("correct", check("correct")),), error_reward=-1.0)

    def __init__(self, raise_in: str = "") -> None:
        self.total = 0
        self.raise_in = raise_in

    @tool
    def add(self, n: int) -> str:
        """Add a number.

        Args:
            n: the number
        """
        self.total += n
        return f"total={self.total}"

    @tool(ends_episode=True)
    def submit(self) -> str:
        """Finish."""
        return "ok"

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        return {"correct": float(self.total == 3)}

    def reference(self, task: Task):
        return []


class FaultyEnv(ToolEnv):
    """A ToolEnv whose step raises on the second turn: a bug in the env, not in the model's output."""

    async def step(self, assistant: Message, **kw: Any):
        if self._ep is not None and self._ep.turns >= 1:
            raise KeyError("env bug")
        return await super().step(assistant, **kw)


def _task(i: int) -> Task:
    return Task(id=f"t{i}", domain="tally", prompt=(Message(role="user", content=f"make 3 (task {i})"),),
                limits=Limits(max_turns=8))


SOLVE = [_call("add", {"n": 1}), _call("add", {"n": 2}), _call("submit", {})]


def test_an_episode_that_raises_is_errored_and_the_others_and_the_step_go_on(tok, caplog):
    tasks = [_task(i) for i in range(3)]
    scripts = {(i, g): SOLVE for i in range(3) for g in range(2)}
    made: list[int] = []

    def make_env(task: Task):
        made.append(1)
        if task.id == "t1" and len(made) % 2 == 0:  # one of task 1's two episodes gets the faulty env
            return FaultyEnv(Tally())
        if task.id == "t2" and len(made) == 6:
            raise OSError("no sandbox for you")   # make_env itself fails for one episode
        return ToolEnv(Tally())

    eng = SeededScriptEngine(tok, scripts)
    with caplog.at_level(logging.ERROR, logger="jointrl.agent_loop"):
        groups = asyncio.run(run_groups(tasks, 2, make_env, BatchingGenerator(eng), tok, chat, _settings(max_turns=6)))
    eps = [e for g in groups for e in g]
    errored = [e for e in eps if e.grade_error is not None]
    assert len(errored) == 2, [e.grade_error for e in eps]
    assert {e.task_id for e in errored} == {"t1", "t2"}
    for e in errored:
        assert e.metrics["episode_error"] == 1.0 and e.reward in (-1.0, 0.0)
        assert set(e.loss_mask) == {0} and len(e.token_ids) == len(e.loss_mask) == len(e.rollout_logprobs) >= 1
    faulty = next(e for e in errored if e.task_id == "t1")
    assert "KeyError" in faulty.grade_error and faulty.reward == -1.0 and faulty.num_turns == 2
    assert "OSError" in next(e for e in errored if e.task_id == "t2").grade_error
    assert all(e.reward == 1.0 and e.metrics["episode_error"] == 0.0 for e in eps if e.grade_error is None)
    # Each failure left its traceback in the log.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback" in logged and "KeyError: 'env bug'" in logged and "OSError: no sandbox for you" in logged


def test_a_codec_that_raises_costs_a_malformed_call_not_the_episode(tok):
    class BrokenCodec:
        render = staticmethod(chat.render)
        render_turn_suffix = staticmethod(chat.render_turn_suffix)
        calls = 0

        def parse_assistant(self, text: str, turn: int = 0):
            BrokenCodec.calls += 1
            if BrokenCodec.calls == 1:
                raise RecursionError("maximum recursion depth exceeded")
            return chat.parse_assistant(text, turn)

    eng = SeededScriptEngine(tok, {(0, 0): [_call("add", {"n": 5})] + SOLVE})
    [[ep]] = asyncio.run(run_groups([_task(0)], 1, lambda t: ToolEnv(Tally()), BatchingGenerator(eng), tok,
                                    BrokenCodec(), _settings()))
    assert ep.grade_error is None and ep.reward == 1.0 and ep.num_turns == 4
    assert ep.metrics["malformed_calls"] == 1 and "could not be parsed (RecursionError)" in _observations(ep)


def test_engine_failure_ends_the_rollout(tok):
    eng = SeededScriptEngine(tok, {(0, 0): SOLVE, (1, 0): SOLVE}, fail=True)
    with pytest.raises(EngineFailure, match="ConnectionError"):
        asyncio.run(run_groups([_task(0), _task(1)], 1, lambda t: ToolEnv(Tally()), BatchingGenerator(eng), tok, chat,
                               _settings()))


def test_a_rollout_where_every_episode_errors_raises(tok):
    eng = SeededScriptEngine(tok, {(0, 0): SOLVE, (1, 0): SOLVE})
    with pytest.raises(RuntimeError, match="all 2 episodes of the rollout errored"):
        asyncio.run(run_groups([_task(0), _task(1)], 1, lambda t: FaultyEnv(Tally()), BatchingGenerator(eng), tok, chat,
                               _settings()))
