"""swe-v0: fix procedurally injected bugs in real Python libraries, graded by hidden tests (docs/swe.md);
swe-onefunc-v0, its first curriculum rung (onefunc.py)."""
from __future__ import annotations

from envs.base import ToolEnv


def domain_limits(sandbox_limits=None, grade_limits=None) -> dict:
    """The limit keywords of a SWE domain, given only where the caller set them (the domain keeps its defaults)."""
    kw = {}
    if sandbox_limits is not None:
        kw["sandbox_limits"] = sandbox_limits
    if grade_limits is not None:
        kw["grade_limits"] = grade_limits
    return kw


def make_env(*, backend=None, sandbox_limits=None, grade_limits=None, **env_kwargs) -> ToolEnv:
    """`envs.make("swe-v0", backend=..., sandbox_limits=..., grade_limits=..., limits=..., ...)`."""
    from envs.swe.domain import SweDomain

    env_kwargs.setdefault("grade_timeout_s", 180.0)
    return ToolEnv(SweDomain(backend=backend, **domain_limits(sandbox_limits, grade_limits)), **env_kwargs)


def register() -> None:
    from pathlib import Path

    from envs.registry import register as reg
    from envs.swe import onefunc
    from envs.swe.build import sets_marker
    from envs.swe.tasks import ENV_ID, make_tasks

    # The task cache key covers this package's code and the marker a new instance set rewrites.
    sources = sorted(Path(__file__).parent.glob("*.py")) + [sets_marker()]
    reg(ENV_ID, make_env, make_tasks, source_files=sources,
        description="fix injected bugs in toolz / cachetools / tabulate / more-itertools; graded by hidden tests")
    reg(onefunc.ENV_ID, onefunc.make_env, onefunc.make_tasks, source_files=sources,
        description="one-line bugs in one named function of the same four libraries, a failing test shown; "
                    "swe-v0's sandbox, tools and grader: the first rung of the swe curriculum")
