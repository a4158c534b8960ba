"""reasoning-gym's procedural generators as jointrl domains `rg-<name>-v0` (one per dataset).

Modules: catalog (which datasets, their families, reference answers, the constant-answer priors that keep
a domain out of the default mix), tasks (seeded draws split by a question hash, in an interpreter without
hash randomisation), domain (the answer tool / final-message modes and grading), answers (the project's
grammars for answers that scorers would `eval`), judge + judge_worker (the out-of-process `score_answer`). See docs/envs.md, "reasoning-gym domains".
"""
from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent


def register() -> None:
    """Entry point for envs.builtin: registers every dataset of the installed reasoning-gym."""
    import reasoning_gym  # noqa: F401 - a missing package skips the whole adapter with its reason

    from envs.reasoning_gym.catalog import PRIORS, datasets, prior_note
    from envs.reasoning_gym.domain import make_env
    from envs.reasoning_gym.tasks import task_fn
    from envs.registry import register as reg

    ours = tuple(sorted(_HERE.glob("*.py")))
    for info in datasets():
        reg(info.env_id, make_env, task_fn(info), description=f"reasoning-gym {info.family}/{info.name}",
            source_files=ours + (info.source,), default_mix=info.name not in PRIORS, note=prior_note(info.name))
