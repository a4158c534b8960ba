"""Tools as typed Python functions: the `@tool` decorator, OpenAI schemas, argument validation.

An environment author writes a tool as a method with annotated parameters and a Google-style
docstring (`Args:` section). `@tool` turns the signature into an OpenAI function schema (the
same shape `transformers.utils.get_json_schema` produces, which the tests cross-check) and into a
validator the framework runs on the model's raw JSON arguments *before* the tool is called. Every
way the model can get a call wrong (bad JSON, not an object, missing / unexpected / wrongly typed
arguments) comes back as a `ToolArgError` whose message is written for the model to read.

A parameter annotated `ToolContext` is injected by the framework (time left, the task) and is not
part of the schema. This module does not run tools or enforce budgets: see `envs.base.ToolEnv`.

Supported annotations: str, int, float, bool, list[T], dict[str, T], Literal[...] (of str, int,
float, bool, None), unions of these (`str | int`, `list[str] | str`) and Optional / `T | None`.
A union of primitives becomes a JSON `type` list, any other union an `anyOf`, and None a
`"nullable": true` (transformers' conventions). Anything else is refused when the tool is defined
(an author error, not a model error).

Validation accepts exactly what the schema allows, with no coercion between JSON types: booleans
are not integers, `"3"` is a string (refused for an `int` parameter, with a hint to drop the
quotes; a `str | int` parameter receives the string and the tool decides what a numeric string
means), and JSON integers widen to `float` parameters (JSON Schema's "number" includes them) unless
they are too large for a float (refused, where JSON Schema would accept them).
A union tries the arms that take the value's JSON type as it is first, so `3` stays an int for
`int | float`. Errors name the argument (`tool.arg[2]`) and the allowed types.

`ToolSpec.parse_arguments` raises `ToolArgError` and nothing else, whatever the text: arguments longer
than the env's `max_arg_chars`, nested deeper than `MAX_ARG_DEPTH`, or holding an integer too long for
Python to decode are malformed calls like any other invalid JSON (decoding goes through
`jointrl.safejson`).
"""
from __future__ import annotations

import inspect
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Union, get_args, get_origin

from jointrl import safejson
from jointrl.records import Task

# Deepest nesting accepted in a tool's arguments object (the object itself is level 1). Schemas here
# nest a few levels (`list[list[str]]` inside the object is 3); the cap keeps decoding and validation
# shallow whatever the model writes.
MAX_ARG_DEPTH = 32


@dataclass(frozen=True)
class ToolContext:
    """What the framework hands a tool that asks for it (parameter annotated `ToolContext`).

    timeout_s: the time this call may take (per-tool timeout capped by the episode's time left);
    a sandboxed tool passes it on to the sandbox so the command is killed, not just abandoned.
    """

    timeout_s: float
    task: Task
    turn: int


class ToolArgError(ValueError):
    """The model's arguments do not fit the tool's schema; the message is shown to the model."""


class ToolDefinitionError(TypeError):
    """The author's tool cannot be described as an OpenAI function (unsupported annotation...)."""


@dataclass(frozen=True)
class ToolSpec:
    """A tool's description: its schema, how to validate arguments, and whether it ends the episode."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object
    ends_episode: bool
    context_param: str | None  # name of the injected ToolContext parameter, if any
    annotations: Mapping[str, Any]  # parameter name -> annotation (for validation)
    required: tuple[str, ...]

    def openai_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(json.dumps(self.parameters))}}

    def parse_arguments(self, raw: str, max_chars: int) -> dict[str, Any]:
        """Raw JSON text from the model -> validated keyword arguments, or ToolArgError (nothing else)."""
        if not isinstance(raw, str):
            raise ToolArgError(f"arguments of '{self.name}' must be JSON text, got {type(raw).__name__}")
        if len(raw) > max_chars:
            raise ToolArgError(f"arguments of '{self.name}' are {len(raw)} characters; the limit is {max_chars}")
        text = raw.strip() or "{}"  # an empty string is how some parsers write "no arguments"
        try:
            # Bounded decoding: over-deep nesting and over-long integers are JSON errors here, not
            # RecursionError / ValueError escaping into the episode.
            args = safejson.loads(text, max_depth=MAX_ARG_DEPTH)
        except safejson.JSONInputError as e:
            raise ToolArgError(f"arguments of '{self.name}' are not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise ToolArgError(f"arguments of '{self.name}' must be a JSON object, got {_json_type(args)}")
        unexpected = sorted(set(args) - set(self.annotations))
        if unexpected:
            allowed = ", ".join(self.annotations) or "none"
            shown = ", ".join(_short(k) for k in unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            raise ToolArgError(f"'{self.name}' got unexpected argument(s) {shown}; it takes: {allowed}")
        missing = [p for p in self.required if p not in args]
        if missing:
            raise ToolArgError(f"'{self.name}' is missing required argument(s): {', '.join(missing)}")
        return {k: _check_value(f"{self.name}.{k}", v, self.annotations[k]) for k, v in args.items()}


# ----------------------------------------------------------------------------- the decorator
_SPEC_ATTR = "__jointrl_tool__"


def tool(fn: Callable | None = None, *, name: str | None = None, ends_episode: bool = False):
    """Mark a method as a tool. `@tool` or `@tool(ends_episode=True)` (e.g. `submit`)."""

    def wrap(f: Callable) -> Callable:
        setattr(f, _SPEC_ATTR, build_spec(f, name=name, ends_episode=ends_episode))
        return f

    return wrap(fn) if fn is not None else wrap


def tool_spec(fn: Callable) -> ToolSpec | None:
    return getattr(fn, _SPEC_ATTR, None)


def collect_tools(obj: object) -> dict[str, tuple[ToolSpec, Callable]]:
    """The @tool methods of `obj`, bound, by tool name, in definition order (MRO, subclass first)."""
    found: dict[str, tuple[ToolSpec, Callable]] = {}
    for klass in type(obj).__mro__:
        for attr, member in vars(klass).items():
            spec = tool_spec(member) if callable(member) else None
            if spec is not None and spec.name not in found:
                found[spec.name] = (spec, getattr(obj, attr))
    return found


def build_spec(fn: Callable, *, name: str | None = None, ends_episode: bool = False) -> ToolSpec:
    tool_name = name or fn.__name__
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", tool_name):
        raise ToolDefinitionError(f"tool name {tool_name!r} is not a valid OpenAI function name")
    summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    if not summary:
        raise ToolDefinitionError(f"tool '{tool_name}' needs a docstring: it is the description the model reads")
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    annotations: dict[str, Any] = {}
    required: list[str] = []
    context_param = None
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "self":
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool '{tool_name}': *args / **kwargs cannot be described to the model")
        if pname not in hints:
            raise ToolDefinitionError(f"tool '{tool_name}': parameter '{pname}' has no type annotation")
        tp = hints[pname]
        if tp is ToolContext:
            context_param = pname
            continue
        prop = _schema_of(tp, f"{tool_name}.{pname}")
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        annotations[pname] = tp
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return ToolSpec(name=tool_name, description=summary, parameters=parameters, ends_episode=ends_episode,
                    context_param=context_param, annotations=annotations, required=tuple(required))


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Google style: the text before `Args:` is the description; `name: text` lines below it."""
    parts = re.split(r"^\s*Args:\s*$", doc, maxsplit=1, flags=re.M)
    summary = parts[0].strip()
    # Other sections (Returns:, Raises:) end the Args block and are not part of the description.
    summary = re.split(r"^\s*(Returns|Raises):\s*$", summary, maxsplit=1, flags=re.M)[0].strip()
    arg_docs: dict[str, str] = {}
    if len(parts) == 2:
        block = re.split(r"^\s*(Returns|Raises):\s*$", parts[1], maxsplit=1, flags=re.M)[0]
        current = None
        for line in block.splitlines():
            m = re.match(r"^\s*(\w+)(\s*\([^)]*\))?:\s*(.*)$", line)
            if m:
                current = m.group(1)
                arg_docs[current] = m.group(3).strip()
            elif current and line.strip():
                arg_docs[current] = (arg_docs[current] + " " + line.strip()).strip()
    return summary, arg_docs


_PRIMS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_FLOAT_MAX = int(sys.float_info.max)
_NONE = type(None)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _schema_of(tp: Any, where: str) -> dict[str, Any]:
    """Annotation -> JSON schema, the same dict `transformers.utils.get_json_schema` builds
    (transformers/utils/chat_template_utils.py `_parse_type_hint`), so a chat template renders our
    tools exactly as it would render the author's plain function."""
    if _is_union(tp):
        arms = [a for a in get_args(tp) if a is not _NONE]
        subs = [_schema_of(a, where) for a in arms]
        if len(subs) == 1:
            s = subs[0]
        elif all(set(x) == {"type"} and isinstance(x["type"], str) for x in subs):
            # Plain primitives: one "type" list, sorted and de-duplicated (transformers' order).
            names = sorted({x["type"] for x in subs})
            s = {"type": names[0] if len(names) == 1 else names}
        else:  # an arm with items / enum / additionalProperties cannot share a type list
            s = {"anyOf": subs}
        if _NONE in get_args(tp):
            s["nullable"] = True  # OpenAI / transformers convention for Optional, not JSON Schema's "null" type
        return s
    if tp in _PRIMS:
        return {"type": _PRIMS[tp]}
    origin = get_origin(tp)
    if origin is Literal:
        values = list(get_args(tp))
        bad = [v for v in values if type(v) not in (*_PRIMS, _NONE)]
        if not values or bad:
            raise ToolDefinitionError(f"{where}: Literal values must be str, int, float, bool or None, got {values!r}")
        kinds: list[str] = []  # JSON types in order of first appearance (transformers' order)
        for v in values:
            k = _PRIMS.get(type(v), "null")
            if k not in kinds:
                kinds.append(k)
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}
    if origin is list:
        (item,) = get_args(tp) or (None,)
        if item is None:
            raise ToolDefinitionError(f"{where}: write list[T], not a bare list")
        return {"type": "array", "items": _schema_of(item, where + "[]")}
    if origin is dict:
        kt, vt = get_args(tp) or (None, None)
        if kt is not str:
            raise ToolDefinitionError(f"{where}: only dict[str, T] can be described (JSON keys are strings)")
        return {"type": "object", "additionalProperties": _schema_of(vt, where + "{}")}
    raise ToolDefinitionError(f"{where}: annotation {tp!r} is not supported "
                              "(use str/int/float/bool/list/dict/Literal, unions of them, Optional)")


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


_RANK = {"string": 1, "integer": 2, "number": 3, "boolean": 4, "null": 9}


def _describe_rank(text: str) -> tuple[int, str]:
    """Compound arms (arrays, objects, literals) first, then primitives in JSON-schema order, null last."""
    return (_RANK.get(text, 0), text if text not in _RANK else "")


def _describe(tp: Any) -> str:
    """An annotation in the words of the schema the model was shown: 'integer or string', 'array of string'."""
    if _is_union(tp):
        # A fixed order, not get_args order: typing caches unions, so `str | int` may come back as
        # a cached `int | str` created elsewhere first (the order then depends on import order).
        return " or ".join(sorted((_describe(a) for a in get_args(tp)), key=_describe_rank))
    if tp is _NONE:
        return "null"
    if tp in _PRIMS:
        return _PRIMS[tp]
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in get_args(tp))
    if origin is list:
        return f"array of {_describe(get_args(tp)[0])}"
    return f"object of {_describe(get_args(tp)[1])}"


def _kinds(tp: Any) -> set[str]:
    """The JSON types (as `_json_type` names them) a value must have to be accepted by `tp` without widening."""
    if _is_union(tp):
        return set().union(*(_kinds(a) for a in get_args(tp)))
    if tp is _NONE:
        return {"null"}
    if tp in _PRIMS:
        return {_PRIMS[tp]}
    origin = get_origin(tp)
    if origin is Literal:
        return {_json_type(a) for a in get_args(tp)}
    return {"array"} if origin is list else {"object"}


def _got(v: Any) -> str:
    """How a rejected value is shown to the model: its JSON type, and the value itself when short."""
    if isinstance(v, (list, dict)) or (isinstance(v, str) and len(v) > 40):
        return _json_type(v)
    text = json.dumps(v)
    return f"{_json_type(v)} {text}" if len(text) <= 40 else _json_type(v)


def _short(key: str, n: int = 40) -> str:
    """An argument name as the error shows it: as is when it looks like a name, else JSON-quoted and cut."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) and len(key) <= n:
        return key
    return json.dumps(key[:n] + ("..." if len(key) > n else ""))


def _check_value(where: str, v: Any, tp: Any) -> Any:
    """Validate a decoded JSON value against an annotation; return it as the tool receives it.

    Accepts exactly what the annotation's JSON schema accepts, with two deliberate readings:
    a JSON integer is accepted for a `float` (it is a JSON number) and converted to float, and
    JSON `3.0` is refused for an `int` (Python's json decodes it as float; JSON Schema would call
    it an integer). No other coercion: "3" is a string, and a string is refused for `int` with
    an error the model can act on; booleans are never integers.
    """
    if _is_union(tp):
        arms = get_args(tp)
        if v is None and _NONE in arms:
            return None
        kind = _json_type(v)
        # Arms that take this JSON type as it is come first, so 3 stays int for `int | float` and a
        # string stays a string for `str | int`; an int reaches a `float` arm only if nothing else fits.
        exact = [a for a in arms if a is not _NONE and kind in _kinds(a)]
        for arm in exact + [a for a in arms if a is not _NONE and a not in exact]:
            try:
                return _check_value(where, v, arm)
            except ToolArgError:
                continue
        if len(exact) == 1 and get_origin(exact[0]) in (list, dict):
            _check_value(where, v, exact[0])  # an array for `list[int] | str` with a bad item: say which item
        raise ToolArgError(f"argument '{where}' must be {_describe(tp)}, got {_got(v)}")
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if not any(v == a and type(v) is type(a) for a in allowed):
            raise ToolArgError(f"argument '{where}' must be one of {', '.join(json.dumps(a) for a in allowed)}, got {json.dumps(v)[:80]}")
        return v
    if origin is list:
        if not isinstance(v, list):
            raise ToolArgError(f"argument '{where}' must be an array, got {_json_type(v)}")
        (item,) = get_args(tp)
        return [_check_value(f"{where}[{i}]", x, item) for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise ToolArgError(f"argument '{where}' must be an object, got {_json_type(v)}")
        _, vt = get_args(tp)
        return {k: _check_value(f"{where}.{k}", x, vt) for k, x in v.items()}
    expected = _PRIMS[tp]
    if expected == "string":
        ok = isinstance(v, str)
    elif expected == "integer":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif expected == "number":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok and isinstance(v, int) and not -_FLOAT_MAX <= v <= _FLOAT_MAX:
            # A JSON number, but not one a float can hold (math.isfinite would raise OverflowError).
            raise ToolArgError(f"argument '{where}' is out of range for a number ({len(str(abs(v)))} digits)")
        ok = ok and math.isfinite(v)
    else:
        ok = isinstance(v, bool)
    if not ok:
        hint = ""
        if expected in ("integer", "number") and isinstance(v, str) and re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", v):
            hint = f" (write the number without quotes: {v.strip()})"
        raise ToolArgError(f"argument '{where}' must be {expected}, got {_got(v)}{hint}")
    return float(v) if tp is float else v
