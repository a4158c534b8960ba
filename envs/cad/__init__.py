"""cad-v0: build a described mechanical part with CadQuery; graded by exact B-rep volume IoU x a feature term.

Layout: `families.py` (9 parametric part families: specs and reference code), `tasks.py` (splits,
prompts, pictures), `domain.py` (the tools and the grader), `worker.py` (warm trusted cadquery
processes), `render.py` (numpy view renderer + PNG writer), `kernel/` (geometry and the
in-sandbox runner; mounted read-only into the agent's sandbox), `primitive.py` (cad-primitive-v0,
the curriculum's first rung: single primitives, same sandbox and grader). See docs/cad.md.
"""
from __future__ import annotations

from envs.base import ToolEnv


def make_env(*, backend=None, sandbox_limits=None, pool=None, prompt_views: bool = False, **env_kwargs) -> ToolEnv:
    """`envs.make("cad-v0", backend=..., sandbox_limits=..., pool=..., prompt_views=..., limits=..., max_calls_per_turn=...)`.

    prompt_views: the user message carries the target's four views as an image (a policy that takes images)."""
    from envs.cad.domain import CadDomain, CadEnv

    kw = {} if sandbox_limits is None else {"sandbox_limits": sandbox_limits}
    return CadEnv(CadDomain(backend=backend, pool=pool, **kw), prompt_views=prompt_views, **env_kwargs)


def register() -> None:
    import importlib.util

    if importlib.util.find_spec("cadquery") is None:
        raise ModuleNotFoundError("No module named 'cadquery' (pip install cadquery==2.8.0)", name="cadquery")
    from envs.cad.tasks import ENV_ID, make_tasks
    from envs.registry import register as reg

    from pathlib import Path

    here = Path(__file__).resolve().parent
    sources = sorted(here.glob("*.py")) + sorted(here.glob("kernel/*.py"))
    reg(ENV_ID, make_env, make_tasks, source_files=sources,
        description="CadQuery part modelling (9 parametric families) graded by exact-solid IoU x hole/face/bbox checks")
    from envs.cad import primitive

    reg(primitive.ENV_ID, primitive.make_env, primitive.make_tasks, source_files=sources,
        description="one box, cylinder or box with a through-hole, dimensions given, one submit; same sandbox and "
                    "grader: the first rung of the CAD curriculum")
