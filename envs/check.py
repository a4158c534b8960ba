"""The conformance checker every environment must pass (`jointrl envs check ID`), after Gymnasium's check_env.

`check_env(env_id, n_tasks=...)` runs, and reports each as passed / failed (with the reason):
  registry       the id resolves; the factory builds a `ToolEnv` (budgets enforced by the framework)
  determinism    the same (split, seed, n) gives identical task rows; another seed gives other tasks
  task types     tasks are `Task`s, survive `to_row` / `from_row`, have unique ids and the right split
  held-out       no held-out task shares `Task.private["variant"]` with a train task
  reset types    reset returns Messages and valid OpenAI function schemas
  reference      the domain's reference solution scores 1 on each checked task (no grade error)
  do-nothing     ending the episode at once, doing nothing else, scores 0 (no grade error). The episode
                 must end by its ending tool (or an empty final reply) with no malformed call: a
                 "do-nothing" that calls `submit` without its required arguments is an error message and
                 a truncated episode, which scores 0 without testing anything. The domain's own `noop`
                 is used when it has one; otherwise the checker calls the ending tool with empty values
                 ("", 0, false, [], {}) for its required arguments.
  best constant  for domains that take a free-text answer (they declare `constant_candidates(tasks)`;
                 the answer goes to an ending tool with one required string argument, or is a final
                 reply): the best mean reward on held-out tasks over a candidate set of constant answers
                 (`CONSTANT_CANDIDATES`, the most frequent `private["reference"]` answers of both splits,
                 and the domain's own candidates). Fails at >= CONSTANT_LIMIT unless the registry marks
                 the domain out of the default mix (`EnvSpec.default_mix`).
  close          close() twice is fine; step() after close() does not raise
  max turns      an episode of plain-text replies is truncated after exactly max_turns, fixed reward
  wall time      an exhausted episode time budget truncates the episode and runs no tool
  obs clipping   with a tiny max_obs_chars every observation fits it
  malformed      text without a call, bad JSON, a non-object, an unknown tool, a wrongly typed and an
                 oversize argument each get an error message, count as malformed, and the episode goes on
The per-tool timeout cannot be triggered generically (it needs a slow tool); each domain's tests
cover it (tests/envs/terminal/test_domain.py for terminal-v0).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from envs.base import Domain, ToolEnv, ToolInvocation, messages_for_calls
from envs.play import ScriptedPolicy, run_episode
from envs.registry import generate_tasks, make, spec
from envs.tools import collect_tools
from jointrl.records import Message, Task, ToolCall

# The generic constant answers every free-text domain is tried with (the red team used these).
CONSTANT_CANDIDATES = ("0", "1", "2", "-1", "10", "0.5", "yes", "no", "Yes", "No", "True", "False", "true", "false",
                       "None", "A", "B", "[]", "{}", "yes no", "True False", "0 1", "0123456789")
CONSTANT_LIMIT = 0.2   # a constant answer scoring this much on held-out tasks is a prior the policy can learn
CONSTANT_TOP_K = 6     # most frequent reference answers taken from each split


@dataclass(frozen=True)
class ConstantBaseline:
    """The best constant answer of a domain on its held-out tasks (`best_constant`)."""

    answer: str
    mean_reward: float
    n_tasks: int
    n_candidates: int


@dataclass(frozen=True)
class CheckItem:
    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class CheckReport:
    env_id: str
    items: tuple[CheckItem, ...]

    @property
    def passed(self) -> bool:
        return bool(self.items) and all(i.passed for i in self.items)

    def failures(self) -> list[CheckItem]:
        return [i for i in self.items if not i.passed]

    def render(self) -> str:
        lines = [f"conformance check of {self.env_id}: {'PASSED' if self.passed else 'FAILED'}"]
        for i in self.items:
            lines.append(f"  [{'ok' if i.passed else 'FAIL'}] {i.name}" + (f": {i.detail}" if i.detail else ""))
        return "\n".join(lines)


class _Checker:
    def __init__(self, env_id: str, env_kwargs: dict[str, Any]) -> None:
        self.env_id = env_id
        self.env_kwargs = env_kwargs
        self.items: list[CheckItem] = []

    def record(self, name: str, fn: Callable[[], str | None]) -> bool:
        try:
            detail = fn() or ""
            self.items.append(CheckItem(name, True, detail))
            return True
        except Exception as e:  # noqa: BLE001 - every failure becomes a line of the report
            msg = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
            self.items.append(CheckItem(name, False, msg or traceback.format_exc(limit=2)))
            return False

    def make(self, **kw: Any) -> ToolEnv:
        env = make(self.env_id, **{**self.env_kwargs, **kw})
        assert isinstance(env, ToolEnv), f"factory returned {type(env).__name__}, not a ToolEnv"
        return env

    def episode(self, task: Task, policy, **kw: Any):
        async def go():
            env = self.make(**kw)
            try:
                return await run_episode(env, task, policy, max_steps=200)
            finally:
                env.close()
        return asyncio.run(go())


def _row_equal(a: list[Task], b: list[Task]) -> bool:
    return [t.to_row() for t in a] == [t.to_row() for t in b]


def _ender(env: ToolEnv):
    return next((s for s, _ in collect_tools(env.domain).values() if s.ends_episode), None)


_EMPTY = {"string": "", "integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}


def _empty_value(prop: dict) -> Any:
    t = prop.get("type")
    if t is None and "anyOf" in prop:
        t = next((a.get("type") for a in prop["anyOf"] if a.get("type") != "null"), None)
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    if "enum" in prop:
        return prop["enum"][0]
    return _EMPTY.get(t, "")


def do_nothing(env: ToolEnv, task: Task) -> list[ToolInvocation] | list[Message]:
    """The do-nothing episode: the domain's own `noop` when it defines one, else the ending tool called with
    empty values for its required arguments; for a domain whose episode ends on a reply, an empty reply."""
    if type(env.domain).noop is not Domain.noop:
        invs = env.noop(task)
        if invs or not env.domain.text_ends_episode:
            return invs
        return [Message(role="assistant", content="")]
    ender = _ender(env)
    if ender is not None:
        props = ender.parameters.get("properties", {})
        return [ToolInvocation(ender.name, {k: _empty_value(props.get(k, {})) for k in ender.required})]
    return [Message(role="assistant", content="")] if env.domain.text_ends_episode else []


def constant_episode(env: ToolEnv, text: str) -> list[ToolInvocation] | list[Message] | None:
    """The episode that answers `text` and nothing else, or None when the domain takes no free-text answer:
    its ending tool when that has exactly one required argument, a string; else a final reply. Only
    domains that declare `constant_candidates(tasks)` take part (an answer domain does; a domain whose
    ending tool takes code, like CAD's `submit(code)`, would spend a full grade on every constant)."""
    if not callable(getattr(env.domain, "constant_candidates", None)):
        return None
    ender = _ender(env)
    if ender is not None:
        props = ender.parameters.get("properties", {})
        if len(ender.required) == 1 and props.get(ender.required[0], {}).get("type") == "string":
            return [ToolInvocation(ender.name, {ender.required[0]: text})]
        return None
    if env.domain.text_ends_episode:
        return [Message(role="assistant", content=text)]
    return None


def _candidates(env: ToolEnv, train: list[Task], held: list[Task]) -> list[str]:
    out = list(CONSTANT_CANDIDATES)
    for tasks in (train, held):
        refs = Counter(str(t.private["reference"]) for t in tasks if isinstance(t.private.get("reference"), str))
        out += [a for a, _ in refs.most_common(CONSTANT_TOP_K)]
    extra = getattr(env.domain, "constant_candidates", None)
    if callable(extra):
        out += [str(x) for x in extra(train + held)]
    return list(dict.fromkeys(out))


def best_constant(env_id: str, held: list[Task], train: list[Task] | None = None, *,
                  env_kwargs: dict[str, Any] | None = None, screen: int = 16) -> ConstantBaseline | None:
    """The best constant answer's mean reward over `held` (None when the domain takes no free-text answer).

    Every candidate is scored on the first `screen` tasks and the three best on all of `held`: the screen
    keeps the check to seconds, and can miss a constant that pays only on the tasks after it (held-out
    tasks come in generator order, not sorted by answer, so the first 16 are a sample of the rest)."""
    kw = dict(env_kwargs or {})
    env0 = make(env_id, **kw)
    try:
        assert isinstance(env0, ToolEnv)
        if constant_episode(env0, "0") is None or not held:
            return None
        cands = _candidates(env0, list(train or []), held)
    finally:
        env0.close()

    async def mean(text: str, tasks: list[Task]) -> float:
        total = 0.0
        for t in tasks:
            env = make(env_id, **kw)
            try:
                tr = await run_episode(env, t, ScriptedPolicy(constant_episode(env, text) or []), max_steps=4)
            finally:
                env.close()
            if tr.grade.error is not None:
                raise AssertionError(f"{t.id}: constant {text!r}: grade error: {tr.grade.error}")
            total += tr.grade.reward
        return total / len(tasks)

    async def go() -> ConstantBaseline:
        first = held[:screen]
        scored = sorted([(await mean(c, first), c) for c in cands], key=lambda x: -x[0])
        finals = [(await mean(c, held), c) if len(held) > len(first) else (m, c) for m, c in scored[:3]]
        m, c = max(finals, key=lambda x: x[0])
        return ConstantBaseline(c, m, len(held), len(cands))

    return asyncio.run(go())


def check_env(env_id: str, n_tasks: int = 4, seed: int = 0, n_generate: int = 64,
              env_kwargs: dict[str, Any] | None = None, n_constant: int | None = None) -> CheckReport:
    """Run the conformance checks on `n_tasks` train tasks (episodes) and `n_generate` generated tasks per split;
    the best-constant check scores its candidates on `n_constant` held-out tasks (default: all `n_generate`;
    0 skips it, for suites that test it elsewhere)."""
    c = _Checker(env_id, dict(env_kwargs or {}))
    if not c.record("registry", lambda: (spec(env_id), c.make().close(), None)[-1]):
        return CheckReport(env_id, tuple(c.items))
    train: list[Task] = []

    def determinism() -> str:
        nonlocal train
        train = generate_tasks(env_id, "train", seed, n_generate)
        assert _row_equal(train, generate_tasks(env_id, "train", seed, n_generate)), "train tasks differ between two generations"
        assert _row_equal(generate_tasks(env_id, "heldout", seed, 8), generate_tasks(env_id, "heldout", seed, 8)), \
            "held-out tasks differ between two generations"
        other = generate_tasks(env_id, "train", seed + 1, n_generate)
        assert not _row_equal(train, other), f"seeds {seed} and {seed + 1} give identical tasks"
        return f"{len(train)} train tasks"

    c.record("determinism", determinism)

    def task_types() -> None:
        assert train, "the generator returned no tasks"
        for t in train:
            assert isinstance(t, Task), f"{type(t).__name__} is not a Task"
            back = Task.from_row(json.loads(json.dumps(t.to_row())))
            assert back.to_row() == t.to_row(), f"task {t.id} does not survive to_row/from_row"
            assert t.prompt and all(isinstance(m, Message) for m in t.prompt), f"task {t.id}: empty or untyped prompt"
        assert len({t.id for t in train}) == len(train), "duplicate task ids"

    c.record("task types", task_types)

    held: list[Task] = []

    def heldout() -> str:
        nonlocal held
        held = generate_tasks(env_id, "heldout", seed, n_generate)
        missing = [t.id for t in train + held if "variant" not in t.private]
        assert not missing, f"tasks without private['variant'] (needed to verify held-out parameters): {missing[:3]}"
        shared = {t.private["variant"] for t in train} & {t.private["variant"] for t in held}
        assert not shared, f"held-out tasks reuse train parameters: {sorted(shared)[:3]}"
        return f"{len({t.private['variant'] for t in held})} held-out variants, none in train"

    c.record("held-out disjoint", heldout)
    if not train:
        return CheckReport(env_id, tuple(c.items))
    tasks = train[:n_tasks]

    def reset_types() -> None:
        async def go():
            env = c.make()
            try:
                msgs, tools = await env.reset(tasks[0])
            finally:
                env.close()
            assert isinstance(msgs, list) and all(isinstance(m, Message) for m in msgs), "reset messages are not Messages"
            assert isinstance(tools, list), "reset tools is not a list"
            for s in tools:
                fn = s.get("function", {})
                assert s.get("type") == "function" and isinstance(fn.get("name"), str), f"bad tool schema {s}"
                assert fn.get("parameters", {}).get("type") == "object", f"tool {fn.get('name')}: parameters must be an object schema"
                json.dumps(s)
        asyncio.run(go())

    c.record("reset types", reset_types)

    def scores(policy_name: str, want: float) -> Callable[[], str]:
        def run() -> str:
            got = []
            for t in tasks:
                env0 = c.make()
                invs = env0.reference(t) if policy_name == "reference" else do_nothing(env0, t)
                ends_on_reply = env0.domain.text_ends_episode
                env0.close()
                tr = c.episode(t, ScriptedPolicy(invs))
                assert tr.grade.error is None, f"{t.id}: grade error: {tr.grade.error}"
                if policy_name == "noop":
                    bad = tr.grade.metrics.get("malformed_calls", 0)
                    assert not bad, (f"{t.id}: the do-nothing episode made {bad:g} malformed call(s), so it tested "
                                     "nothing: give Domain.noop valid arguments for the ending tool")
                    if invs or ends_on_reply:
                        assert tr.terminated, f"{t.id}: the do-nothing episode did not end (turns={tr.turns})"
                label = "do-nothing" if policy_name == "noop" else policy_name
                assert abs(tr.grade.reward - want) < 1e-9, f"{t.id}: {label} scored {tr.grade.reward}, expected {want}"
                got.append(tr.grade.reward)
            return f"{len(got)} tasks scored {want:g}"
        return run

    c.record("reference scores 1", scores("reference", 1.0))
    c.record("do-nothing scores 0", scores("noop", 0.0))

    def constant() -> str:
        if n_constant == 0:
            return "skipped (n_constant=0)"
        held_c = held if n_constant is None else held[:n_constant]
        b = best_constant(env_id, held_c, train, env_kwargs=c.env_kwargs)
        if b is None:
            return "not applicable (the domain takes no free-text answer)"
        s = spec(env_id)
        line = (f"best of {b.n_candidates} constant answers: {b.answer[:40]!r} scores {b.mean_reward:.3f} "
                f"on {b.n_tasks} held-out tasks (limit {CONSTANT_LIMIT})")
        if b.mean_reward < CONSTANT_LIMIT:
            return line
        assert not s.default_mix, f"{line}; fix the domain, or mark it (default_mix=False, with its prior)"
        return f"{line}; marked, out of the default mix: {s.note}"

    if held:
        c.record("best constant", constant)

    def close_twice() -> None:
        async def go():
            env = c.make()
            await env.reset(tasks[0])
            env.close()
            env.close()
            res = await env.step(Message(role="assistant", content="hello"))
            assert res.truncated or res.terminated, "step after close() reports a running episode"
        asyncio.run(go())

    c.record("close idempotent", close_twice)
    t0 = tasks[0]

    def max_turns() -> None:
        limits = dataclasses.replace(t0.limits, max_turns=3)
        tr = c.episode(t0, ScriptedPolicy([]), limits=limits)
        assert tr.truncated and not tr.terminated and tr.turns == 3, f"turns={tr.turns} truncated={tr.truncated}"
        env = c.make()
        want = env.domain.rubric.truncated_reward
        env.close()
        assert tr.grade.reward == want and tr.grade.error is None, f"truncated episode scored {tr.grade.reward}, not {want}"

    c.record("max turns enforced", max_turns)

    def wall_time() -> None:
        limits = dataclasses.replace(t0.limits, episode_timeout_s=1e-6)

        async def go():
            env = c.make(limits=limits)
            try:
                await env.reset(t0)
                ref = env.reference(t0)
                res = await env.step(messages_for_calls(ref[:1])[0])
                assert res.truncated, "episode not truncated after its time budget"
                assert all("Not executed" in m.content for m in res.messages), "a tool ran after the time budget"
            finally:
                env.close()
        asyncio.run(go())

    c.record("episode wall time enforced", wall_time)

    def clipping() -> str:
        limits = dataclasses.replace(t0.limits, max_obs_chars=48)
        env0 = c.make()
        ref = env0.reference(t0)
        env0.close()
        tr = c.episode(t0, ScriptedPolicy(ref), limits=limits)
        obs = [m for m in tr.messages if m.role in ("tool", "user") and m not in t0.prompt]
        assert obs and all(len(m.content) <= 48 for m in obs), "an observation exceeds max_obs_chars"
        return f"{len(obs)} observations <= 48 chars"

    c.record("observation clipping", clipping)

    def malformed() -> str:
        async def go():
            env = c.make(limits=dataclasses.replace(t0.limits, max_turns=50, max_arg_chars=1000))
            try:
                await env.reset(t0)
                name, params = _first_tool_with_param(env)
                wrong = _wrong_value(params[1]) if params else None
                cases = [
                    ("no tool call", Message(role="assistant", content="I think I am done.")),
                    ("invalid JSON", _call(name, '{"x": ')),
                    ("non-object JSON", _call(name, "[1, 2]")),
                    ("unknown tool", _call("no_such_tool_xyz", "{}")),
                    ("oversize arguments", _call(name, json.dumps({"x": "a" * 5000}))),
                ]
                if params:
                    cases.append(("wrong argument type", _call(name, json.dumps({params[0]: wrong}))))
                for what, msg in cases:
                    res = await env.step(msg)
                    assert not res.terminated and not res.truncated, f"{what}: the episode ended"
                    assert len(res.messages) == 1 and "rror" in res.messages[0].content, f"{what}: no error message"
                    if msg.tool_calls:
                        assert res.messages[0].role == "tool" and res.messages[0].tool_call_id == msg.tool_calls[0].id, \
                            f"{what}: the error does not answer the call"
                g = await env.grade()
                assert g.error is None, f"grading after malformed turns failed: {g.error}"
                assert g.metrics.get("malformed_calls") == len(cases), f"malformed_calls={g.metrics.get('malformed_calls')}, expected {len(cases)}"
                return f"{len(cases)} malformed kinds answered"
            finally:
                env.close()
        return asyncio.run(go())

    c.record("malformed output handled", malformed)
    return CheckReport(env_id, tuple(c.items))


def _call(name: str, args: str) -> Message:
    return Message(role="assistant", content="", tool_calls=(ToolCall(id="call_bad", name=name, arguments=args),))


def _first_tool_with_param(env: ToolEnv) -> tuple[str, tuple[str, dict] | None]:
    schemas = env.tool_schemas
    for s in schemas:
        props = s["function"]["parameters"].get("properties", {})
        for pname, p in props.items():
            return s["function"]["name"], (pname, p)
    return schemas[0]["function"]["name"], None


def _wrong_value(prop: dict) -> Any:
    """A value of the wrong JSON type for a parameter schema (a union's types are all avoided)."""
    types = prop.get("type")
    if types is None and "anyOf" in prop:
        types = [t for arm in prop["anyOf"] for t in ([arm["type"]] if isinstance(arm.get("type"), str) else arm.get("type", []))]
    allowed = set([types] if isinstance(types, str) else types or [])
    for value, kinds in (({"a": 1}, {"object"}), ([1, 2], {"array"}), ("twelve", {"string"}), (12345, {"integer", "number"}),
                         (True, {"boolean"})):
        if not kinds & allowed:
            return value
    return None
