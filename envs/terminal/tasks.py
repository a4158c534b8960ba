"""Task generation for terminal-v0: deterministic in (split, seed, index); held-out variants disjoint from train.

For each family, its finite list of structural variants is ranked by a hash of (family, variant);
the first 20% (at least one) are held out. Task `i` of a split uses family `i mod F` and a
`random.Random` seeded by (seed, split, family, i): the same arguments give the same tasks on any
machine (Python seeds a Random from a str through SHA-512), and no held-out task shares its
variant with any train task. `Task.private["variant"]` records it so `check_env` can verify that.
"""
from __future__ import annotations

import base64
import random

from envs.terminal.basics import BASIC_FAMILIES
from envs.terminal.families import FAMILIES, Family, Instance
from envs.splits import split_by_hash, tasks_of_split
from envs.splits import variant_key as _variant_key
from jointrl.records import Limits, Message, Task

ENV_ID = "terminal-v0"
BASICS_ENV_ID = "terminal-basics-v0"
HELDOUT_FRACTION = 0.2
DEFAULT_N = {"train": 40 * len(FAMILIES), "heldout": 8 * len(FAMILIES)}
LIMITS = Limits(max_turns=16, tool_timeout_s=10.0, episode_timeout_s=180.0, max_obs_chars=4000, max_arg_chars=20_000)
# terminal-basics-v0: one command + submit per task; more held-out tasks so success rates are measurable.
BASICS_DEFAULT_N = {"train": 100 * len(BASIC_FAMILIES), "heldout": 20 * len(BASIC_FAMILIES)}
BASICS_LIMITS = Limits(max_turns=4, tool_timeout_s=5.0, episode_timeout_s=60.0, max_obs_chars=2000, max_arg_chars=2000)

SYSTEM_PROMPT = (
    "You are working in a Linux shell inside a sandbox with no network access. Use the `bash` tool to run commands; "
    "every command starts in the task's working directory, where all the files mentioned in the task are. "
    "When the files are in their final state, call `submit`. Only the final state of the working directory is graded.")


def variant_key(family: Family, variant: tuple) -> str:
    return _variant_key(family.name, variant)


def split_variants(family: Family) -> dict[str, list[tuple]]:
    return split_by_hash(family.name, family.variants(), HELDOUT_FRACTION, min_variants=2)


def _encode_files(inst: Instance) -> list[dict]:
    out = []
    for path in sorted(inst.files):
        data = inst.files[path]
        entry: dict = {"path": path, "mode": inst.modes.get(path, 0o644)}
        try:
            entry["text"] = data.decode("utf-8")
        except UnicodeDecodeError:
            entry["b64"] = base64.b64encode(data).decode()
        out.append(entry)
    return out


def make_task(split: str, seed: int, index: int, *, env_id: str = ENV_ID) -> Task:
    basics = env_id == BASICS_ENV_ID
    families = list((BASIC_FAMILIES if basics else FAMILIES).values())
    family = families[index % len(families)]
    rng = random.Random(f"{env_id}:{seed}:{split}:{family.name}:{index}")
    variant = rng.choice(split_variants(family)[split])
    inst = family.generate(rng, variant)
    return Task(
        id=f"{env_id}/{split}/s{seed}/{index:05d}-{family.name}",
        domain="terminal",
        prompt=(Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=inst.instruction)),
        public={"family": family.name, "files": _encode_files(inst), "setup": list(inst.setup)},
        private={"family": family.name, "variant": variant_key(family, variant), "check": inst.check,
                 "reference": list(inst.reference)},
        limits=BASICS_LIMITS if basics else LIMITS,
        thinking="low",
        split=split,
    )


def make_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    return tasks_of_split(make_task, DEFAULT_N, split, seed, n)


def make_basics_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    if split not in BASICS_DEFAULT_N:
        raise ValueError(f"unknown split {split!r}; splits are: {', '.join(BASICS_DEFAULT_N)}")
    return [make_task(split, seed, i, env_id=BASICS_ENV_ID) for i in range(BASICS_DEFAULT_N[split] if n is None else n)]
