"""Property-based fuzzing (hypothesis) of tool-argument validation and of every tool's handler, through `Env.step`.

Properties:
- `ToolSpec.parse_arguments` raises `ToolArgError` and nothing else on any text (deep nesting, huge
  numbers, lone surrogates, garbage), and on decoded objects it accepts exactly what `jsonschema` accepts;
- `Env.step` never raises on any assistant `Message` (any names, ids, argument texts, content, and the
  codec's `parse_errors`), answers every call in order, and every observation is a str that encodes as
  UTF-8 (the tokenizer refuses lone surrogates) and fits `max_obs_chars`; `grade()` then returns a
  finite reward.
The handlers fuzzed for real are terminal-v0's (`bash`, `submit`, on the bubblewrap backend; terminal-
basics-v0 is the same domain) and browse's (`search`, `open`, `find`, `answer`, on browse-small-v0: the
same domain and tools as browse-v0 on a smaller corpus), plus a pure-Python domain with every supported
annotation kind. Runs are bounded and derandomised: a given checkout and test selection sees the same
examples every time. SWE and CAD tools are not covered here.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import types
from typing import Any, Literal, Mapping, Union, get_args, get_origin

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from envs.base import Domain, ToolEnv
from envs.tools import MAX_ARG_DEPTH, ToolArgError, collect_tools, tool
from jointrl.records import Limits, Message, Task, ToolCall
from rewards import Rubric, Term, check
from tests.envs.test_tools import _to_json_schema

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DEEP = '{"x": ' + "[" * 1200 + "]" * 1200 + "}"
HUGE = '{"x": ' + "7" * 19_000 + "}"

BIG = st.sampled_from([10**400, -(10**400), 2**1024])  # past a float's range; JSON still decodes them
json_scalars = (st.none() | st.booleans() | st.integers(min_value=-10**40, max_value=10**40) | BIG
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=16))
json_values = st.recursive(json_scalars, lambda k: st.lists(k, max_size=4) | st.dictionaries(st.text(max_size=6), k, max_size=4),
                           max_leaves=12)
odd_texts = st.sampled_from([DEEP, HUGE, "", " ", "{", "[]", "null", "NaN", '{"x": NaN}', '{"x": Infinity}',
                             '"\\ud800"', '{"x": "\\ud800"}', '{"x": "\\u0000"}', "{}" * 3,
                             '{"' + "k" * 5000 + '": 1}', '{"x": 1e999}', "\x00", '{"x": ' + "9" * 4300 + "}"])


def value_for(tp: Any) -> st.SearchStrategy:
    """Values of an annotation's JSON type (what a schema-following model would write)."""
    if get_origin(tp) in (Union, types.UnionType):
        return st.one_of([value_for(a) for a in get_args(tp)])
    if tp is type(None):
        return st.none()
    if tp is str:
        return st.text(max_size=40)
    if tp is int:
        return st.integers(min_value=-10**30, max_value=10**30) | BIG
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False) | BIG
    if tp is bool:
        return st.booleans()
    if get_origin(tp) is Literal:
        return st.sampled_from(get_args(tp))
    if get_origin(tp) is list:
        return st.lists(value_for(get_args(tp)[0]), max_size=4)
    if get_origin(tp) is dict:
        return st.dictionaries(st.text(max_size=8), value_for(get_args(tp)[1]), max_size=3)
    raise TypeError(tp)


def argument_texts(spec) -> st.SearchStrategy:
    """Argument text for one tool: schema-following, arbitrary JSON objects, raw text, or pathological."""
    typed = st.fixed_dictionaries({}, optional={k: value_for(tp) for k, tp in spec.annotations.items()})
    return st.one_of(typed.map(json.dumps), st.dictionaries(st.text(max_size=8), json_values, max_size=4).map(json.dumps),
                     st.text(max_size=60), odd_texts)


def typed_arguments(spec) -> st.SearchStrategy:
    """Schema-following argument objects: required arguments present, optional ones sometimes."""
    req = {k: value_for(spec.annotations[k]) for k in spec.required}
    opt = {k: value_for(tp) for k, tp in spec.annotations.items() if k not in spec.required}
    return st.fixed_dictionaries(req, optional=opt).map(json.dumps)


def messages_for(specs: Mapping[str, Any]) -> st.SearchStrategy:
    """Assistant messages with 0-3 calls; most calls reach a handler (a known tool, schema-valid arguments)."""
    names = list(specs)

    @st.composite
    def garbage(draw):
        name = draw(st.sampled_from(names) | st.text(max_size=12))
        spec = specs.get(name) or specs[names[0]]
        return ToolCall(id=draw(st.text(max_size=8)), name=name, arguments=draw(argument_texts(spec)))

    # Episode-ending tools drawn less often, so that episodes last long enough to exercise the others.
    weighted = [n for n in names for _ in range(1 if specs[n].ends_episode else 4)]

    @st.composite
    def valid(draw):
        name = draw(st.sampled_from(weighted))
        return ToolCall(id=draw(st.text(max_size=8)), name=name, arguments=draw(typed_arguments(specs[name])))

    calls = st.one_of(valid(), valid(), garbage())
    return st.builds(lambda content, tcs, reasoning: Message(role="assistant", content=content, tool_calls=tuple(tcs),
                                                             reasoning=reasoning),
                     st.text(max_size=30), st.lists(calls, max_size=3), st.none() | st.text(max_size=20))


parse_errors = st.lists(st.text(max_size=80), max_size=3).map(tuple)


def _refused(text: str) -> bool:
    return text.startswith(("Error: unknown tool", "Error: skipped", "Not executed", "Error: arguments of",
                            "Error: argument '")) or " is missing required argument" in text or "unexpected argument" in text


class Driver:
    """Steps one env through fuzzed messages on one event loop, resetting when an episode ends."""

    def __init__(self, env: ToolEnv, tasks: list[Task]):
        self.env, self.tasks, self.loop, self.i = env, tasks, asyncio.new_event_loop(), 0
        self.ran: dict[str, int] = {}  # tool name -> calls that reached its handler
        self.reset()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def reset(self):
        self.run(self.env.reset(self.tasks[self.i % len(self.tasks)]))
        self.i += 1

    def step(self, msg: Message, errors: tuple[str, ...]) -> None:
        limits = self.env.limits
        res = self.run(self.env.step(msg, parse_errors=errors))
        for m in res.messages:  # a handler ran unless the framework refused the call first
            if m.role == "tool" and not _refused(m.content):
                self.ran[m.name or ""] = self.ran.get(m.name or "", 0) + 1
        n_tool = sum(m.role == "tool" for m in res.messages)
        assert n_tool == len(msg.tool_calls)
        assert [m.tool_call_id for m in res.messages if m.role == "tool"] == [c.id for c in msg.tool_calls]
        for m in res.messages:
            assert m.role in ("tool", "user") and isinstance(m.content, str)
            assert "could not be validated" not in m.content, m.content  # the framework's backstop never fires
            m.content.encode("utf-8")  # raises on a lone surrogate
            assert len(m.content) <= limits.max_obs_chars
        if res.terminated or res.truncated:
            g = self.run(self.env.grade())
            assert math.isfinite(g.reward), g
            self.reset()

    def close(self):
        self.env.close()
        self.loop.close()


# ----------------------------------------------------------------------------- argument validation
class AllKinds(Domain):
    """Every supported annotation kind, and an episode that never ends by itself."""

    rubric = Rubric((Term("correct", check("correct")),))

    @tool
    def prims(self, s: str, i: int, f: float, b: bool, o: str | None = None) -> str:
        """Primitives.

        Args:
            s: a string
            i: an int
            f: a float
            b: a bool
            o: optional
        """
        return json.dumps([s, i, f, b, o])

    @tool
    def compound(self, xs: list[list[int]], m: dict[str, float], mode: Literal["a", 1, None], u: list[str | int] | str = "") -> dict:
        """Compound types.

        Args:
            xs: nested lists
            m: a mapping
            mode: a literal
            u: a union
        """
        return {"xs": xs, "m": m, "mode": mode, "u": u}

    @tool(ends_episode=True)
    def done(self) -> str:
        """End."""
        return "bye"

    def check(self, task, transcript):
        return {"correct": 0.0}

    def reference(self, task):
        return []


SPECS = {s.name: s for s, _ in collect_tools(AllKinds()).values()}


@settings(FUZZ, max_examples=400)
@given(st.sampled_from(sorted(SPECS)), st.data())
@example("compound", None)
def test_parse_arguments_raises_only_tool_arg_errors(name, data):
    spec = SPECS[name]
    text = DEEP if data is None else data.draw(argument_texts(spec))
    try:
        out = spec.parse_arguments(text, max_chars=50_000)
    except ToolArgError as e:
        assert str(e)
    else:
        assert isinstance(out, dict) and set(out) <= set(spec.annotations)


@settings(FUZZ, max_examples=200)
@given(st.sampled_from(sorted(SPECS)), st.data())
def test_parse_arguments_accepts_exactly_what_the_schema_accepts(name, data):
    spec = SPECS[name]
    obj = data.draw(st.fixed_dictionaries({}, optional={k: value_for(tp) | json_values for k, tp in spec.annotations.items()})
                    | st.dictionaries(st.text(max_size=6), json_values, max_size=3))
    assume(not _outside_comparison(obj))
    text = json.dumps(obj)
    try:
        ORACLES[name].validate(obj)
        ok = True
    except jsonschema.ValidationError:
        ok = False
    try:
        spec.parse_arguments(text, max_chars=10**6)
        accepted = True
    except ToolArgError:
        accepted = False
    assert accepted == ok, (text, spec.parameters)


def _strict(schema: Mapping[str, Any]) -> dict:
    """The tool schema as the jsonschema oracle reads it: `nullable` as a null arm, no extra properties."""
    out = _to_json_schema(json.loads(json.dumps(schema)))
    out["additionalProperties"] = False
    return out


ORACLES = {name: jsonschema.Draft202012Validator(_strict(spec.parameters)) for name, spec in SPECS.items()}


def _outside_comparison(v: Any) -> bool:
    """Where our validator reads JSON differently from jsonschema, on purpose (envs/tools.py): 3.0 is a float
    (jsonschema: an integer), and an integer too large for a float is refused for a float parameter."""
    if isinstance(v, float):
        return v.is_integer()
    if isinstance(v, int) and not isinstance(v, bool):
        return abs(v) > sys.float_info.max
    if isinstance(v, list):
        return any(_outside_comparison(x) for x in v)
    if isinstance(v, dict):
        return any(_outside_comparison(x) for x in v.values())
    return False


def test_nesting_limit_is_exact():
    spec = SPECS["compound"]
    ok = {"xs": [[1]], "m": {}, "mode": "a"}
    assert spec.parse_arguments(json.dumps(ok), 10**6)["xs"] == [[1]]
    at_limit = '{"u": ' + "[" * (MAX_ARG_DEPTH - 1) + "]" * (MAX_ARG_DEPTH - 1) + ', "xs": [], "m": {}, "mode": 1}'
    with pytest.raises(ToolArgError, match="array"):  # within the limit: an ordinary type error
        spec.parse_arguments(at_limit, 10**6)
    over = '{"u": ' + "[" * MAX_ARG_DEPTH + "]" * MAX_ARG_DEPTH + "}"
    with pytest.raises(ToolArgError, match=f"nested deeper than {MAX_ARG_DEPTH} levels"):
        spec.parse_arguments(over, 10**6)
    with pytest.raises(ToolArgError, match="more than 4300 digits"):
        spec.parse_arguments(HUGE, 10**6)


# ----------------------------------------------------------------------------- Env.step, every handler
def _task(domain: str, limits: Limits) -> Task:
    return Task(id="fuzz", domain=domain, prompt=(Message(role="user", content="fuzz"),), limits=limits)


@pytest.fixture(scope="module")
def allkinds():
    drv = Driver(ToolEnv(AllKinds()), [_task("x", Limits(max_turns=50, max_obs_chars=300))])
    yield drv
    drv.close()


@settings(FUZZ, max_examples=300)
@given(messages_for(SPECS), parse_errors)
def test_step_never_raises_on_a_pure_python_domain(allkinds, msg, errors):
    allkinds.step(msg, errors)


@pytest.fixture(scope="module")
def terminal(backend):
    import envs
    from jointrl.records import Task as T

    limits = Limits(max_turns=10_000, tool_timeout_s=2.0, episode_timeout_s=3600.0, max_obs_chars=2000, max_arg_chars=20_000)
    env = envs.make("terminal-v0", backend=backend, limits=limits)
    tasks = [T.from_row(r) for r in envs.tasks("terminal-v0", "train", seed=0, n=2)]
    drv = Driver(env, tasks)
    yield drv, {s.name: s for s, _ in collect_tools(env.domain).values()}
    drv.close()


@settings(FUZZ, max_examples=80)
@given(st.data())
def test_terminal_handlers_never_raise_out_of_step(terminal, data):
    drv, specs = terminal
    drv.step(data.draw(messages_for(specs)), data.draw(parse_errors))


def test_terminal_fuzzing_reached_every_handler(terminal):
    drv, specs = terminal
    assert set(drv.ran) >= set(specs) and drv.ran["bash"] >= 20, drv.ran


@pytest.fixture(scope="module")
def browse():
    envs = pytest.importorskip("envs")
    from jointrl.records import Task as T

    env = envs.make("browse-small-v0", limits=Limits(max_turns=10_000, tool_timeout_s=10.0, episode_timeout_s=3600.0,
                                                     max_obs_chars=2000))
    tasks = [T.from_row(r) for r in envs.tasks("browse-small-v0", "train", seed=0, n=3)]
    drv = Driver(env, tasks)
    yield drv, {s.name: s for s, _ in collect_tools(env.domain).values()}
    drv.close()


@settings(FUZZ, max_examples=150)
@given(st.data())
def test_browse_handlers_never_raise_out_of_step(browse, data):
    drv, specs = browse
    drv.step(data.draw(messages_for(specs)), data.draw(parse_errors))


def test_browse_fuzzing_reached_every_handler(browse):
    drv, specs = browse
    # Loose floors: hypothesis also draws on literals of the loaded modules, so the exact mix of examples
    # depends on which test modules run together.
    assert set(drv.ran) >= set(specs) and min(drv.ran[n] for n in specs) >= 4, drv.ran
