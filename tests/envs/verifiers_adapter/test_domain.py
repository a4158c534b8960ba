"""envs/verifiers_adapter: the rubric as reward terms in the grading phase, tools in the sandbox.

References: the environment's own reward functions called in the verifiers venv (a separate script,
not the adapter's bridge), and the fixture ToolEnv in fixture_tool_env.py (a real verifiers ToolEnv)."""
from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

import envs
from envs.tools import ToolDefinitionError
from envs.verifiers_adapter import register_environment
from envs.verifiers_adapter.catalog import VerifiersEnvSpec
from envs.verifiers_adapter.domain import annotation_for, domain_class, tool_spec_of
from jointrl.records import Message, Task, ToolCall

FIXTURE = Path(__file__).with_name("fixture_tool_env.py")
HAIKU = "An old lamp burns low\nthe keeper climbs the last stairs\nsalt wind takes the light"


def _episode(env_id: str, task: Task, turns: list[Message]):
    env = envs.make(env_id)

    async def go():
        await env.reset(task)
        results = [await env.step(m) for m in turns]
        return results, await env.grade()

    try:
        return asyncio.run(go())
    finally:
        env.close()


def _reference_reward(vf_python, func: str, completion: str, info: dict) -> float:
    """The environment's own reward function (stardata's constraint gym, or envs/verifiers_adapter/lipogram.py),
    called in the verifiers venv without the adapter."""
    lipogram_dir = Path(envs.__file__).parent / "verifiers_adapter"
    code = (f"import json, sys\nsys.path.insert(0, {str(lipogram_dir)!r})\nfrom stardata.envs import constraint_gym\nimport lipogram\n"
            f"f = getattr(constraint_gym, {func!r}, None) or getattr(lipogram, {func!r})\n"
            f"print(json.dumps(f(completion=[{{'role': 'assistant', 'content': sys.argv[1]}}], info=json.loads(sys.argv[2]))))")
    r = subprocess.run([str(vf_python), "-c", code, completion, json.dumps(info)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1000:]
    return float(r.stdout.strip().splitlines()[-1])


def test_rubric_terms_carry_verifiers_weights(vf_python):
    from envs.verifiers_adapter.catalog import SHIPPED

    cls = domain_class(SHIPPED[0])
    assert [(t.name, t.weight) for t in cls.rubric.terms] == [("prosody_reward", 1.0)]  # weight-0 metrics are checks
    assert cls.text_ends_episode and not envs.make("vf-constraint-gym-v0").tool_schemas


@pytest.mark.parametrize("env_id,func", [("vf-constraint-gym-v0", "prosody_reward"), ("vf-lipogram-v0", "themed_lipogram_reward")])
def test_reward_equals_the_environments_own_function(vf_python, env_id, func):
    tasks = [Task.from_row(r) for r in envs.tasks(env_id, "heldout", seed=0, n=3)]
    for task, text in zip(tasks, [HAIKU, "no", "Slow, dark night\nwinds blow through old trunks\nmist curls on still ponds\nowls hold vigil"]):
        _, g = _episode(env_id, task, [Message(role="assistant", content=text)])
        assert g.error is None, g.error
        want = _reference_reward(vf_python, func, text, json.loads(task.private["info"]))
        assert g.reward == pytest.approx(want) and g.metrics[f"term/{func}"] == pytest.approx(want)


def test_the_rubric_never_sees_the_reasoning(vf_python):
    task = Task.from_row(envs.tasks("vf-lipogram-v0", "heldout", seed=0, n=1)[0])
    _, plain = _episode("vf-lipogram-v0", task, [Message(role="assistant", content="x")])
    _, hidden = _episode("vf-lipogram-v0", task, [Message(role="assistant", content="x", reasoning=HAIKU * 5)])
    assert hidden.reward == plain.reward


def test_a_raising_weighted_function_is_a_grade_error_not_a_zero(vf_python):
    spec = VerifiersEnvSpec("vf-fixture-broken-v0", f"{FIXTURE}:load_broken_rubric", family="vf-test", description="test")
    register_environment(spec)
    task = Task.from_row(envs.tasks(spec.env_id, "train", seed=0, n=1)[0])
    _, g = _episode(spec.env_id, task, [Message(role="assistant", content="0")])
    assert g.error is not None and "broken_reward" in g.error and "this rubric is broken" in g.error
    assert g.metrics["grade_error"] == 1.0


def test_json_schema_parameters_become_validated_annotations():
    spec = tool_spec_of({"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"enum": ["x", "y"]},
                                         "d": {"type": "array", "items": {"type": "number"}}},
        "required": ["a", "c"]}})
    assert spec.parse_arguments(json.dumps({"a": "s", "c": "x", "d": [1, 2.5]}), 1000) == {"a": "s", "c": "x", "d": [1.0, 2.5]}
    assert spec.parse_arguments(json.dumps({"a": "s", "c": "x", "b": None}), 1000)["b"] is None  # optional -> nullable
    for bad in ({"c": "x"}, {"a": 1, "c": "x"}, {"a": "s", "c": "z"}, {"a": "s", "c": "x", "e": 1}):
        with pytest.raises(envs.ToolArgError):
            spec.parse_arguments(json.dumps(bad), 1000)
    with pytest.raises(ToolDefinitionError, match="not supported"):
        annotation_for({"type": "object", "properties": {"x": {"type": "string"}}}, "f.nested")


@pytest.mark.slow
def test_tools_run_in_the_sandbox_and_the_rubric_grades_the_reply(vf_python, backend):
    spec = VerifiersEnvSpec("vf-fixture-tool-v0", f"{FIXTURE}:load_environment", family="vf-test", description="test")
    register_environment(spec)
    task = Task.from_row(envs.tasks(spec.env_id, "train", seed=0, n=1)[0])
    answer = json.loads(task.private["answer"])
    code = "import os; print(6 * 7, os.getuid()); print(os.path.exists('" + str(FIXTURE.parents[3] / "README.md") + "'))"
    turns = [Message(role="assistant", tool_calls=(ToolCall("c1", "run_python", json.dumps({"code": code})),)),
             Message(role="assistant", tool_calls=(ToolCall("c2", "run_python", json.dumps({"code": 5})),)),
             Message(role="assistant", content=f"The answer is {answer}.")]
    results, g = _episode(spec.env_id, task, turns)
    out = results[0].messages[0].content.split()
    assert out[0] == "42" and int(out[1]) != 0 and out[2] == "False"  # ran as a sandbox uid; the repo is not visible
    assert "must be string" in results[1].messages[0].content  # validated before any process starts
    assert g.error is None and g.reward == 1.0 and g.metrics["malformed_calls"] == 1.0
