"""Prime Intellect's `verifiers` environments as jointrl domains (`vf-<name>-v0`).

verifiers and the environment packages live in a venv of their own (scripts/setup.sh builds
`<cache>/verifiers-venv`; `$JOINTRL_VERIFIERS_PYTHON` points elsewhere), because their pins do not fit
jointrl's venv; jointrl reaches them through `bridge.py`, run by that venv's Python.

Modules: catalog (which environments, their families and splits), judge (the venv, the long-lived bridge
per environment), bridge (the verifiers side), tasks (dataset rows -> Tasks, disjoint splits), domain
(rubric -> reward terms in the grading phase, tools in the sandbox). See docs/envs.md, "verifiers
environments".
"""
from __future__ import annotations

from pathlib import Path

from envs.verifiers_adapter.catalog import SHIPPED, VerifiersEnvSpec

_HERE = Path(__file__).parent


def register_environment(spec: VerifiersEnvSpec) -> None:
    """Register one verifiers environment as a jointrl domain (for other packages' `jointrl.envs` entry points).
    Nothing is loaded until its tasks or an env are asked for."""
    from envs.registry import register as reg
    from envs.verifiers_adapter.domain import make_env_for
    from envs.verifiers_adapter.tasks import task_fn

    reg(spec.env_id, make_env_for(spec), task_fn(spec), description=spec.description,
        source_files=tuple(sorted(_HERE.glob("*.py"))), default_mix=spec.default_mix, note=spec.note)


def register() -> None:
    """Entry point for envs.builtin: the shipped environments, when the verifiers venv exists."""
    from envs.verifiers_adapter.judge import PYTHON_ENV, verifiers_python

    py = verifiers_python()
    if not py.exists():
        # Reported like a missing optional package: `jointrl envs list` shows the reason.
        raise ModuleNotFoundError(f"no verifiers venv at {py} (scripts/setup.sh builds it; or set {PYTHON_ENV})",
                                  name="verifiers")
    for spec in SHIPPED:
        register_environment(spec)
