"""Which reasoning-gym datasets become jointrl domains, their families, and their reference answers.

Every dataset in reasoning-gym's registry (`reasoning_gym.factory.DATASETS`) with its default config is
a domain `rg-<name>-v0`, except those in `EXCLUDED` (`composite`, a mixture of the others; a dataset
whose scorer accepts any answer) and datasets without a reference answer the checker can replay (`entry["answer"]` is None and the metadata
holds no example solution): they are listed in `SKIPPED` with the reason.

A domain's family is the subpackage reasoning-gym files the dataset under (`reasoning_gym.<family>.<module>`:
algebra, algorithmic, arc, arithmetic, code, cognition, games, geometry, graphs, induction, logic,
probability). It is the sampling level above domains and the grouping of the dashboards; it travels in
every task's `public["family"]`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "rg-"
VERSION = "v0"
EXCLUDED = {
    "composite": "a mixture of the other datasets, not a task family of its own",
    # Found by tests/envs/reasoning_gym/test_grader.py: every wrong answer scored 1.
    # Found by `jointrl envs check`: two generations of the same (seed, index) differ (the sampled
    # programs draw from sources no seed reaches), so the task set is not reproducible.
    "codeio": "its generator is not deterministic in (seed, index)",
    "game_of_life_halting": "its score_answer accepts any non-empty answer (bool(answer) == bool(entry['answer']))",
}
# Datasets whose `entry["answer"]` is None keep one valid solution in their metadata under one of these keys.
EXAMPLE_KEYS = ("possible_answer", "example_answer", "example_correct_answer")
# Checked against the installed version by tests/envs/reasoning_gym/test_catalog.py.
NO_REFERENCE_DATASETS = frozenset({"boxnet", "rush_hour"})
NO_REFERENCE = "no reference answer (entry['answer'] is None and the metadata holds no example solution)"


# Domains whose best constant answer scores >= 0.2 on held-out tasks under the project's rules: the answer
# is one of a few values by construction (True/False, a small count, a colour, a move name), or one answer
# is right for many tasks (a root of 0, a disjunction of two premises' atoms), so no scorer rule can take
# the prior away. Registered with `default_mix=False` and this note (envs.registry.EnvSpec): a run names
# them on purpose, and scripts/many_domains_config.py leaves them out. Measured on the 64 held-out tasks of
# seed 0 with the candidate set of envs.check (docs/adapters.md has the table and the command).
PRIORS: dict[str, tuple[float, str]] = {
    "propositional_logic": (0.797, "(Q ∨ P)"),   # any valid conclusion counts; this one follows from most premise sets
    "syllogism": (0.703, "Yes"),
    "circuit_logic": (0.547, "0"),
    "course_schedule": (0.531, "True"),
    "isomorphic_strings": (0.516, "True"),
    "ransom_note": (0.516, "True"),
    "rectangle_count": (0.448, "4"),
    "mahjong_puzzle": (0.391, "Chi"),
    "acre": (0.359, "on"),
    "self_reference": (0.359, "2"),
    "zebra_puzzles": (0.359, "bob"),
    "rotten_oranges": (0.328, "-1"),
    "shortest_path": (0.328, "infeasible"),
    "gcd": (0.312, "2"),
    "letter_counting": (0.297, "1"),
    "polynomial_equations": (0.281, "0"),          # after its all-or-nothing rule: 0 is the only root of many
    "aiw": (0.281, "3"),
    "maze": (0.281, "5"),
    "color_cube_rotation": (0.211, "gold"),
}


# Domains re-split instead of marked: their answer takes many values but a few of them dominate (count_bits:
# popcounts of random integers, around half their width), so no answer may make up more than this share of a
# split's task set, at any prefix of it (envs/reasoning_gym/tasks.py: `build_tasks` skips an item whose answer
# has its share already). The items left are the same kind of question; the share bounds a constant answer's
# prior by the cap (plus 1/n: tasks.py). Measured before / after in docs/adapters.md.
ANSWER_SHARE_CAP: dict[str, float] = {
    "count_bits": 0.1,          # 18 values; "17" scored 0.234 on held-out
    "binary_alternation": 0.13,  # 10 values (swaps, -1 when impossible), 8 of them common; "4" scored 0.219
}


def prior_note(name: str) -> str:
    """The registry note of a domain in `PRIORS` ("" for the others)."""
    if name not in PRIORS:
        return ""
    score, answer = PRIORS[name]
    return f"constant-answer prior {score:.3f}: the answer {answer!r} scores {score:.3f} on held-out tasks"


@dataclass(frozen=True)
class DatasetInfo:
    name: str            # reasoning-gym's dataset name, e.g. "basic_arithmetic"
    env_id: str          # "rg-basic_arithmetic-v0"
    family: str          # reasoning-gym's subpackage, e.g. "arithmetic"
    source: Path         # the generator's module file (hashed into the task-cache key)


def skipped() -> dict[str, str]:
    """dataset name -> why it is not a domain."""
    return {**EXCLUDED, **{n: NO_REFERENCE for n in sorted(NO_REFERENCE_DATASETS)}}


def env_id_for(name: str) -> str:
    return f"{ENV_PREFIX}{name}-{VERSION}"


@lru_cache(maxsize=1)
def datasets() -> tuple[DatasetInfo, ...]:
    """Every dataset of the installed reasoning-gym except those in `skipped()`."""
    import sys

    from reasoning_gym.factory import DATASETS

    out = []
    for name, (cls, _cfg) in sorted(DATASETS.items()):
        if name in EXCLUDED or name in NO_REFERENCE_DATASETS:
            continue
        parts = cls.__module__.split(".")
        family = parts[1] if len(parts) >= 3 else "other"
        out.append(DatasetInfo(name, env_id_for(name), family, Path(sys.modules[cls.__module__].__file__)))
    return tuple(out)


def by_env_id() -> dict[str, DatasetInfo]:
    return {d.env_id: d for d in datasets()}


def families() -> dict[str, list[str]]:
    """family -> env ids, each list sorted."""
    out: dict[str, list[str]] = {}
    for d in datasets():
        out.setdefault(d.family, []).append(d.env_id)
    return out


def reference_answer(entry: Mapping[str, Any]) -> str | None:
    """The answer the generator knows is right: `entry["answer"]`, else an example solution from the
    metadata (JSON-encoded when it is not text). None when there is neither."""
    if entry.get("answer") is not None:
        return str(entry["answer"])
    meta = entry.get("metadata") or {}
    for k in EXAMPLE_KEYS:
        v = meta.get(k)
        if v is not None:
            return v if isinstance(v, str) else json.dumps(v)
    return None
