"""A verifiers ToolEnv for the adapter's tests, loaded by the verifiers venv's Python from this file.

Its one tool runs Python code in a subprocess (so, under the adapter, inside jointrl's sandbox); the
rubric gives 1 when the final reply contains the row's answer, and a weight-0 metric counts tool calls.
"""
import subprocess
import sys

import verifiers as vf
from datasets import Dataset


def run_python(code: str) -> str:
    """Run Python code and return what it printed.

    Args:
        code: the program text
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    return (r.stdout + r.stderr)[-2000:]


def correct(completion, answer, **kwargs) -> float:
    text = completion[-1].get("content", "") if isinstance(completion, list) and completion else str(completion)
    return 1.0 if str(answer) in text else 0.0


def tool_calls(completion, **kwargs) -> float:
    return float(sum(len(m.get("tool_calls") or []) for m in completion if isinstance(m, dict)))


def load_environment(n: int = 12):
    rows = [{"question": f"What is {a} * {a + 3}? Use the tool.", "answer": str(a * (a + 3))} for a in range(2, 2 + n)]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[run_python],
                      rubric=vf.Rubric(funcs=[correct, tool_calls], weights=[1.0, 0.0]), max_turns=4)


def broken_reward(completion, **kwargs) -> float:
    raise ValueError("this rubric is broken")


def load_broken_rubric():
    """A SingleTurnEnv whose weighted reward function raises: jointrl must report a grade error, not a 0."""
    rows = [{"question": f"Say {i}.", "answer": str(i)} for i in range(8)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[broken_reward], weights=[1.0]))
