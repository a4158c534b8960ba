"""The verifiers side of the adapter: a small program run by the verifiers venv's Python, never by jointrl's.

verifiers (and the environment packages built on it) pin versions jointrl's own venv cannot take (see
docs/envs.md, "verifiers environments"), so they live in a venv of their own and jointrl talks to this
program over pipes, one JSON object per line:

    python bridge.py serve MODULE:LOADER KWARGS_JSON     requests on stdin, one reply line each on stdout
    python bridge.py call_tool MODULE:LOADER KWARGS_JSON one request on stdin ({"name", "args"}), one reply

Requests of `serve`:
    {"op": "describe"}  -> the environment's kind, tools, reward functions (name, weight) and dataset rows
                           (train, and eval when the environment has its own eval split)
    {"op": "score", "prompt", "completion", "answer", "info", "task"}
                        -> {"values": {function name: float}} for every reward function of the rubric,
                           or {"error": text} naming the function that raised
Every reply is {"ok": true, ...} or {"ok": false, "error": text}.

It imports only the standard library at module level (jointrl's venv imports it too, for its constants
and the layering checks) and the verifiers stack inside the functions. It does not sandbox anything:
`serve` is the grading-phase judge (it runs the rubric the environment author wrote, on transcripts);
`call_tool` is what runs inside jointrl's sandbox when the policy calls a tool.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
from typing import Any

PROTOCOL = 1


def _load(target: str, kwargs: dict[str, Any]):
    """`module:function`, or `/path/to/file.py:function` for an environment kept in a file of its own."""
    module, _, fn = target.rpartition(":")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"vf_env_{abs(hash(module))}", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    return getattr(mod, fn or "load_environment")(**kwargs)


def _plain(x: Any) -> Any:
    """JSON-able copy of a dataset cell (datasets hands back dicts, lists, numpy scalars...)."""
    return json.loads(json.dumps(x, default=str))


def _rubrics(env) -> list:
    r = env.rubric
    return list(getattr(r, "rubrics", None) or [r])


def _funcs(env) -> list[tuple[Any, Any, float]]:
    """(rubric, function, weight) for every reward function, sub-rubrics of a RubricGroup flattened."""
    out = []
    for r in _rubrics(env):
        for f, w in zip(r.funcs, r.weights):
            out.append((r, f, float(w)))
    return out


def _rows(ds) -> list[dict[str, Any]] | None:
    if ds is None:
        return None
    keep = ("prompt", "answer", "info", "task")
    return [{k: _plain(row.get(k)) for k in keep} for row in ds]


def describe(env) -> dict[str, Any]:
    import verifiers as vf

    funcs = _funcs(env)
    group = [getattr(f, "__name__", repr(f)) for r, f, _ in funcs if r._is_group_func(f)]
    if group:
        raise ValueError(f"group-level reward functions are not supported (they score a group, not one episode): {group}")
    names = [getattr(f, "__name__", repr(f)) for _, f, _ in funcs]
    if len(set(names)) != len(names):
        raise ValueError(f"reward function names must be unique to become reward terms, got {names}")
    tools = [{"name": t.name, "description": t.description, "parameters": _plain(t.parameters)}
             for t in (getattr(env, "tool_defs", None) or [])]
    env.build_dataset()
    env.build_eval_dataset()
    return {"protocol": PROTOCOL, "verifiers": vf.__version__, "kind": type(env).__name__, "tools": tools,
            "system_prompt": getattr(env, "system_prompt", None),
            "funcs": [{"name": n, "weight": w} for n, (_, _, w) in zip(names, funcs)],
            "train": _rows(env.dataset), "eval": _rows(env.eval_dataset)}


def score(env, req: dict[str, Any]) -> dict[str, float]:
    """Every reward function on one episode, called as verifiers' Rubric calls it (only the arguments its
    signature names, from the rubric's score objects). A weighted function (weight != 0) must return a
    number, and an exception in it is an error, not verifiers' silent 0. A weight-0 function is a metric:
    a number is kept under its name, a mapping as `<name>.<key>` entries, and an exception as `<name>_failed`."""
    state = {"prompt": req["prompt"], "completion": req["completion"], "answer": req.get("answer", ""),
             "info": req.get("info") or {}, "task": req.get("task"),
             "input": {"prompt": req["prompt"], "answer": req.get("answer", ""), "info": req.get("info") or {}}}
    values: dict[str, float] = {}
    for r, f, w in _funcs(env):
        objects = r.score_objects(state)
        sig = inspect.signature(f)
        takes_all = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
        args = objects if takes_all else {k: v for k, v in objects.items() if k in sig.parameters}
        name = getattr(f, "__name__", repr(f))
        try:
            v = f(**args)
            if inspect.isawaitable(v):
                v = asyncio.run(_await(v))
            if isinstance(v, dict) and w == 0.0:
                values.update({f"{name}.{str(k).replace('/', '.')}": float(x) for k, x in v.items()})
            else:
                values[name] = float(v)
        except Exception as e:  # noqa: BLE001 - reported to the grader, which makes it a grade error
            if w == 0.0:
                values[f"{name}_failed"] = 1.0
                continue
            raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from None
    return values


async def _await(v):
    return await v


def call_tool(env, name: str, args: dict[str, Any]) -> str:
    fn = getattr(env, "tool_map", {}).get(name)
    if fn is None:
        raise KeyError(f"unknown tool {name!r}")
    out = fn(**args)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out if isinstance(out, str) else json.dumps(out, default=str)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("serve", "call_tool"):
        print("usage: bridge.py serve|call_tool MODULE:LOADER KWARGS_JSON", file=sys.stderr)
        return 2
    # Whatever the environment prints goes to stderr: stdout carries only the protocol's lines.
    out, sys.stdout = sys.stdout, sys.stderr
    try:
        env = _load(argv[1], json.loads(argv[2]))
    except Exception as e:  # noqa: BLE001
        sys.stdout = out
        _reply({"ok": False, "error": f"loading {argv[1]} failed: {type(e).__name__}: {e}"})
        return 1
    sys.stdout = out
    if argv[0] == "call_tool":
        req = json.loads(sys.stdin.readline() or "{}")
        try:
            sys.stdout = sys.stderr
            result = call_tool(env, str(req.get("name")), dict(req.get("args") or {}))
            sys.stdout = out
            _reply({"ok": True, "result": result})
        except Exception as e:  # noqa: BLE001 - the model reads this as the tool's error
            sys.stdout = out
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 0
    for line in sys.stdin:
        try:
            req = json.loads(line)
            sys.stdout = sys.stderr
            if req.get("op") == "describe":
                body = describe(env)
            elif req.get("op") == "score":
                body = {"values": score(env, req)}
            else:
                raise ValueError(f"unknown op {req.get('op')!r}")
            sys.stdout = out
            _reply({"ok": True, **body})
        except Exception as e:  # noqa: BLE001
            sys.stdout = out
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
