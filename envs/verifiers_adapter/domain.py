"""A verifiers environment as a jointrl `Domain`: its rubric as reward terms, its tools run in our sandbox.

- Episode: verifiers' chat environments end when the model replies without a tool call, so the domain
  has `text_ends_episode`; a `SingleTurnEnv` offers no tools, a `ToolEnv` offers its tools (the schemas
  verifiers derives from the tool functions, validated here before any call).
- Tools: each call runs `bridge.py call_tool` with the verifiers venv's Python inside a bubblewrap
  sandbox opened for the episode (the venv, its base interpreter and the bridge mounted read-only; no
  network; the sandbox's CPU, memory and process limits), so tool code never runs in the driver. The
  sandbox's work dir lasts the episode, but each call is a new process: tools that keep Python state
  between calls (verifiers' `StatefulToolEnv`) are not supported.
- Grading: `check` sends the prompt, the completion (the messages after the prompt; `content` only,
  never `reasoning`), and the row's answer / info / task to the environment's bridge (judge.py), which
  calls every rubric function in its own process. The reward is jointrl's rubric: one `Term` per
  weighted rubric function with verifiers' weight, so reward = Σ weight · value as verifiers computes
  it. Weight-0 functions (verifiers' metrics) are reported as checks (`check/<name>`), not terms.
- No reference solution: verifiers environments ship none, so `jointrl envs check` cannot run its
  "reference scores 1" check on them (docs/envs.md says what it does run).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Optional, Union

from envs.base import Domain, EnvUsageError, ToolEnv, ToolInvocation
from envs.sandbox.base import Mount, Sandbox, SandboxBackend, SandboxLimits
from envs.tools import _SPEC_ATTR, ToolArgError, ToolContext, ToolDefinitionError, ToolSpec
from envs.verifiers_adapter.catalog import VerifiersEnvSpec
from envs.verifiers_adapter.judge import BRIDGE, describe, shared_bridge, verifiers_python
from jointrl.records import Message, Task
from rewards.rubric import Rubric, Term
from rewards.terms import check

INSIDE = "/opt/jointrl-vf"
# verifiers + datasets + the environment map ~1 GB of address space before the tool runs.
TOOL_LIMITS = SandboxLimits(workdir_mb=64, tmp_mb=64, max_procs=64, address_space_mb=4096, file_size_mb=32,
                            cpu_seconds=60, open_files=512, max_output_bytes=200_000)
TOOL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/hf", "OMP_NUM_THREADS": "1"}
_SCALAR = Union[str, int, float, bool, None]
_PRIM = {"string": str, "integer": int, "number": float, "boolean": bool, "null": type(None)}


def annotation_for(schema: Mapping[str, Any], where: str) -> Any:
    """The Python annotation envs.tools validates a JSON-schema parameter with (flat schemas only)."""
    if "enum" in schema:
        return Literal[tuple(schema["enum"])]
    if "anyOf" in schema:
        return Union[tuple(annotation_for(s, where) for s in schema["anyOf"])]
    t = schema.get("type")
    if isinstance(t, list):
        return Union[tuple(annotation_for({"type": x}, where) for x in t)]
    if t in _PRIM:
        return _PRIM[t]
    if t == "array":
        items = schema.get("items") or {}
        return list[annotation_for(items, where + "[]") if items else _SCALAR]
    if t == "object" and not schema.get("properties"):
        return dict[str, _SCALAR]
    raise ToolDefinitionError(f"tool parameter {where}: schema {json.dumps(schema)[:200]} is not supported "
                              "(flat parameters: strings, numbers, booleans, enums, arrays of them, flat objects)")


def tool_spec_of(tool: Mapping[str, Any]) -> ToolSpec:
    params = dict(tool.get("parameters") or {"type": "object", "properties": {}})
    props = params.get("properties") or {}
    ann = {k: annotation_for(v, f"{tool['name']}.{k}") for k, v in props.items()}
    required = tuple(k for k in params.get("required", ()) if k in props)
    for k in props:  # an optional parameter may be null (verifiers' schemas mark defaults that way)
        if k not in required:
            ann[k] = Optional[ann[k]]
    return ToolSpec(name=str(tool["name"]), description=str(tool.get("description") or tool["name"]), parameters=params,
                    ends_episode=False, context_param="ctx", annotations=ann, required=required)


@functools.lru_cache(maxsize=1)
def default_backend() -> SandboxBackend:
    from envs.sandbox.bwrap import BwrapBackend

    return BwrapBackend()


def sandbox_python(target: str) -> tuple[tuple[Mount, ...], str, str]:
    """Mounts that make the verifiers venv, the bridge and (for a file target) the environment's file visible
    in a sandbox; the interpreter path and the loader target as seen inside."""
    py = verifiers_python()
    venv = py.parent.parent.resolve()
    mounts = [Mount(venv, f"{INSIDE}/venv"), Mount(BRIDGE.parent, f"{INSIDE}/bridge")]
    module, _, fn = target.rpartition(":")
    if module.endswith(".py"):
        src = Path(module).resolve()
        mounts.append(Mount(src.parent, f"{INSIDE}/envsrc"))
        target = f"{INSIDE}/envsrc/{src.name}:{fn}"
    cfg = venv / "pyvenv.cfg"
    home = next((line.split("=", 1)[1].strip() for line in cfg.read_text().splitlines() if line.startswith("home")), "") \
        if cfg.exists() else ""
    base = Path(home).resolve().parent if home else None
    if base is not None and not str(base).startswith("/usr"):  # pyenv / conda base: the venv's symlinks point there
        mounts.append(Mount(base, str(base)))
    return tuple(mounts), f"{INSIDE}/venv/bin/python", target


class VerifiersDomain(Domain):
    """One verifiers environment (the class attributes are set per environment by `domain_class`)."""

    spec: ClassVar[VerifiersEnvSpec]
    rubric: ClassVar[Rubric]
    text_ends_episode: ClassVar[bool] = True

    def __init__(self, backend: SandboxBackend | None = None) -> None:
        self.backend = backend
        self._box: Sandbox | None = None

    @property
    def has_tools(self) -> bool:
        return bool(describe(self.spec.loader())["tools"])

    def setup(self, task: Task) -> None:
        if self.has_tools:
            mounts, _, _ = sandbox_python(self.spec.target)
            self._box = (self.backend or default_backend()).open(limits=TOOL_LIMITS, mounts=mounts)

    def run_tool(self, name: str, args: dict[str, Any], ctx: ToolContext) -> str:
        if self._box is None:
            raise EnvUsageError("tool call outside an episode")
        _, python, target = sandbox_python(self.spec.target)
        argv = [python, "-I", f"{INSIDE}/bridge/bridge.py", "call_tool", target, self.spec.loader().kwargs_json]
        r = self._box.run(argv, timeout_s=ctx.timeout_s, stdin=(json.dumps({"name": name, "args": args}) + "\n").encode(),
                          env=TOOL_ENV)
        if r.timed_out:
            raise TimeoutError(f"killed after {ctx.timeout_s:.0f} s")
        line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
        if line is None:
            raise RuntimeError(f"the tool process exited {r.exit_code} without a result: {r.stderr[-300:]}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise ToolArgError(str(reply.get("error", "tool failed")))
        return str(reply["result"])

    def before_grade(self) -> None:
        if self._box is not None:
            self._box.kill_all()

    def teardown(self) -> None:
        if self._box is not None:
            box, self._box = self._box, None
            box.close()

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        completion = []
        for m in transcript[len(task.prompt):]:
            d = m.to_openai()
            d.pop("reasoning_content", None)  # the rubric grades what the model said, not its thinking
            completion.append(d)
        said = [m for m in transcript[len(task.prompt):] if m.role == "assistant"]
        if not any(m.content.strip() or m.tool_calls for m in said):
            # Nothing said is nothing done: 0 on every term, without asking the rubric (stardata's gives an
            # empty poem its `surface` share, 0.15).
            return {t.name: 0.0 for t in self.rubric.terms}
        p = task.private
        reply = shared_bridge(self.spec.loader()).request(
            {"op": "score", "prompt": json.loads(p["prompt"]), "completion": completion, "answer": json.loads(p["answer"]),
             "info": json.loads(p["info"]), "task": p["task"]})
        return {str(k): float(v) for k, v in reply["values"].items()}

    def reference(self, task: Task) -> list[ToolInvocation]:
        raise EnvUsageError(f"{self.spec.env_id}: verifiers environments ship no reference solution")

    def noop(self, task: Task) -> list[ToolInvocation]:
        return []  # the checker answers with an empty final reply (envs.check.do_nothing)

    def constant_candidates(self, tasks: list[Task]) -> list[str]:
        """Constant replies the conformance checker's best-constant check tries (the spec's `constants`)."""
        return list(self.spec.constants)


def _tool_method(name: str, spec: ToolSpec):
    def call(self, ctx: ToolContext, **args):
        return self.run_tool(name, args, ctx)

    call.__name__ = name
    setattr(call, _SPEC_ATTR, spec)
    return call


@functools.lru_cache(maxsize=None)
def domain_class(spec: VerifiersEnvSpec) -> type[VerifiersDomain]:
    """The Domain subclass of one environment: its rubric (one term per weighted function) and its tools."""
    d = describe(spec.loader())
    terms = tuple(Term(f["name"], check(f["name"]), float(f["weight"])) for f in d["funcs"] if float(f["weight"]) != 0.0)
    if not terms:
        raise ValueError(f"{spec.env_id}: the rubric has no weighted reward function")
    attrs: dict[str, Any] = {"spec": spec, "rubric": Rubric(terms=terms, truncated_reward=0.0, error_reward=0.0)}
    for t in d["tools"]:
        attrs[f"tool_{t['name']}"] = _tool_method(t["name"], tool_spec_of(t))
    name = "".join(x.capitalize() for x in spec.env_id.replace("-", "_").split("_")) + "Domain"
    return type(name, (VerifiersDomain,), attrs)


@functools.lru_cache(maxsize=None)  # one factory per spec: registering twice is a no-op
def make_env_for(spec: VerifiersEnvSpec):
    def make_env(backend: SandboxBackend | None = None, **toolenv_kw) -> ToolEnv:
        return ToolEnv(domain_class(spec)(backend=backend), **toolenv_kw)

    return make_env


__all__ = ["VerifiersDomain", "domain_class", "make_env_for", "tool_spec_of", "annotation_for", "sandbox_python"]
