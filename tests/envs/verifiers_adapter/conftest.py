"""The verifiers venv these tests need (scripts/setup.sh builds it); without it they skip, saying why."""
from __future__ import annotations

import pytest

from envs.verifiers_adapter.judge import PYTHON_ENV, verifiers_python


@pytest.fixture(scope="session")
def vf_python():
    py = verifiers_python()
    if not py.exists():
        pytest.skip(f"no verifiers venv at {py}: scripts/setup.sh builds it (or set {PYTHON_ENV})")
    return py
