"""@tool schemas against transformers' get_json_schema, and argument validation against jsonschema."""
from __future__ import annotations

import json
import random
from typing import Literal

import jsonschema
import pytest
from transformers.utils import get_json_schema

from envs.tools import ToolArgError, ToolContext, ToolDefinitionError, build_spec, collect_tools, tool


def f_basic(command: str, timeout: int = 5, ratio: float = 0.5, verbose: bool = False) -> str:
    """Run a command.

    Args:
        command: the command line
        timeout: seconds before the command is killed
        ratio: a fraction
        verbose: print more
    """


def f_nested(paths: list[str], weights: dict[str, float], mode: Literal["fast", "slow"], limit: int | None = None) -> str:
    """Do a nested thing.

    Args:
        paths: files to read,
            one per entry
        weights: per-name weights
        mode: how to go
        limit: an optional cap
    """


def f_ctx(query: str, ctx: ToolContext) -> str:
    """Search.

    Args:
        query: the query
    """


@pytest.mark.parametrize("fn", [f_basic, f_nested])
def test_schema_matches_transformers_get_json_schema(fn):
    ours = build_spec(fn).openai_schema()
    ref = get_json_schema(fn)
    ref["function"].pop("return", None)
    assert ours == ref


def test_context_parameter_is_injected_not_described():
    spec = build_spec(f_ctx)
    assert spec.context_param == "ctx"
    assert list(spec.parameters["properties"]) == ["query"]
    assert spec.required == ("query",)


@pytest.mark.parametrize("bad", [
    lambda x: None,  # no annotation, no docstring
])
def test_definition_errors(bad):
    with pytest.raises(ToolDefinitionError):
        build_spec(bad)


def test_definition_errors_name_the_problem():
    def no_doc(x: int) -> str:
        return ""

    def bad_type(x: set[int]) -> str:
        """Doc."""

    def kwargs(**kw: int) -> str:
        """Doc."""

    with pytest.raises(ToolDefinitionError, match="docstring"):
        build_spec(no_doc)
    with pytest.raises(ToolDefinitionError, match="not supported"):
        build_spec(bad_type)
    with pytest.raises(ToolDefinitionError, match="kwargs"):
        build_spec(kwargs)


def _random_json(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "str":
        return rng.choice(["a", "fast", "slow", "", "x y"])
    if k == "int":
        return rng.randint(-3, 3)
    if k == "float":
        return rng.choice([0.5, -1.25, 3.0])
    if k == "bool":
        return rng.random() < 0.5
    if k == "null":
        return None
    if k == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "b"]): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 2))}


def _valid_value(prop: dict, rng: random.Random):
    """A value drawn from the schema itself, so accepted objects are common enough to test."""
    if "enum" in prop:
        return rng.choice(prop["enum"])
    t = prop["type"]
    if t == "array":
        return [_valid_value(prop["items"], rng) for _ in range(rng.randint(0, 3))]
    if t == "object":
        return {rng.choice("ab"): _valid_value(prop["additionalProperties"], rng) for _ in range(rng.randint(0, 2))}
    return {"string": "s", "integer": rng.randint(-5, 5), "number": rng.choice([0.25, 2]), "boolean": True}[t]


@pytest.mark.parametrize("fn", [f_basic, f_nested])
def test_validation_agrees_with_jsonschema(fn):
    """Random argument objects: our validator accepts exactly what jsonschema accepts for our schema."""
    spec = build_spec(fn)
    schema = json.loads(json.dumps(spec.parameters))
    # jsonschema does not know OpenAI's "nullable": express it as a type union for the oracle.
    for prop in schema["properties"].values():
        if prop.pop("nullable", False):
            prop["type"] = [prop["type"], "null"]
    schema["additionalProperties"] = False
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(0)
    names = list(spec.annotations)
    agree = accepted = 0
    for _ in range(3000):
        obj = {n: (_valid_value(spec.parameters["properties"][n], rng) if rng.random() < 0.7 else _random_json(rng))
               for n in names if rng.random() < 0.9}
        if rng.random() < 0.05:
            obj["extra"] = 1
        ok_ref = validator.is_valid(obj)
        try:
            spec.parse_arguments(json.dumps(obj), 10_000)
            ok = True
        except ToolArgError:
            ok = False
        # jsonschema treats 3.0 as an integer (a JSON number with zero fraction); we follow Python's
        # json module, which decodes 3.0 as float, and refuse it for an int parameter: skip those.
        if "3.0" in json.dumps(obj):
            continue
        assert ok == ok_ref, (obj, ok, ok_ref)
        agree += 1
        accepted += ok
    assert agree > 1000 and 0 < accepted < agree  # both outcomes were exercised


@pytest.mark.parametrize("raw, msg", [
    ('{"command": ', "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"timeout": 3}', "missing required argument(s): command"),
    ('{"command": "ls", "cwd": "/"}', "unexpected argument(s) cwd"),
    ('{"command": 12}', "'f_basic.command' must be string, got integer"),
    ('{"command": "ls", "timeout": true}', "must be integer, got boolean"),
    ('{"command": "ls", "timeout": 1.5}', "must be integer, got number"),
    ('{"command": "ls", "ratio": NaN}', "must be number"),
])
def test_malformed_arguments_give_readable_errors(raw, msg):
    with pytest.raises(ToolArgError) as e:
        build_spec(f_basic).parse_arguments(raw, 10_000)
    assert msg in str(e.value)


def test_argument_size_cap_applies_before_parsing():
    spec = build_spec(f_basic)
    with pytest.raises(ToolArgError, match="limit is 100"):
        spec.parse_arguments(json.dumps({"command": "x" * 200}), 100)


def test_empty_arguments_mean_no_arguments():
    def ping() -> str:
        """Ping."""

    assert build_spec(ping).parse_arguments("", 10) == {}
    with pytest.raises(ToolArgError, match="missing"):
        build_spec(f_basic).parse_arguments("  ", 10)


def test_float_parameters_accept_ints_and_literals_check_type():
    spec = build_spec(f_nested)
    out = spec.parse_arguments('{"paths": [], "weights": {"a": 1}, "mode": "fast"}', 1000)
    assert out["weights"] == {"a": 1.0} and isinstance(out["weights"]["a"], float)
    with pytest.raises(ToolArgError, match="one of"):
        spec.parse_arguments('{"paths": [], "weights": {}, "mode": "medium"}', 1000)


def test_collect_tools_finds_decorated_methods_with_options():
    class D:
        @tool
        def a(self, x: int) -> str:
            """A."""
            return str(x)

        @tool(ends_episode=True, name="finish")
        def b(self) -> str:
            """B."""
            return "done"

        def not_a_tool(self) -> None:
            pass

    tools = collect_tools(D())
    assert list(tools) == ["a", "finish"]
    assert tools["finish"][0].ends_episode and not tools["a"][0].ends_episode
    assert tools["a"][1](x=3) == "3"
