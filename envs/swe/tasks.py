"""Task generation for swe-v0: one `Task` per built instance, in a seeded order.

The instance set (`instance_set()`) is the full build (scripts/build_swe_instances.py, >= 200 instances over four
libraries) when it is in the cache, else the small set (12 instances from toolz and cachetools),
which is built at first use: about 1-3 minutes on 2 cores, plus the sdist downloads from PyPI
(20-90 s) if they are not cached. After that no network is needed.

`make_tasks(split, seed, n)`: the split's instances shuffled by `Random(f"swe-v0:{split}:{seed}")`,
the first `n` (all when n is None or larger). The split is by library function
(`Task.private["variant"]`), so held-out functions never appear in train.
"""
from __future__ import annotations

import dataclasses
import os
import threading

from envs.swe import build as B
from envs.swe.build import Instance
from jointrl.records import Limits, Message, Task

ENV_ID = "swe-v0"
LIMITS = Limits(max_turns=40, tool_timeout_s=90.0, episode_timeout_s=1200.0, max_obs_chars=6000, max_arg_chars=60_000)

SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a Python library. The repository is checked out in your "
    "working directory (a git repository with a single commit) inside a sandbox without network access. "
    "Tools: `bash` (a shell in the repository), `view` (read a file with line numbers, or list a directory), "
    "`str_replace` (replace one exact, unique occurrence of a string in a file), `run_tests` (run the "
    "repository's tests with pytest, optionally only some of them) and `submit` (finish). Fix the library code "
    "so that the behaviour described in the issue is correct; do not edit the tests. Your change is graded "
    "with the project's full test suite, including tests you cannot see.")

_LOCK = threading.Lock()
_CACHE: dict[str, list[Instance]] = {}


def instance_set() -> list[Instance]:
    """The full set if built, else the small one (built now if missing).

    `JOINTRL_SWE_SET=small` (or `full`) forces one; `full` raises if it is not built.
    """
    choice = os.environ.get("JOINTRL_SWE_SET", "auto")
    if choice not in ("auto", "small", "full"):
        raise ValueError(f"JOINTRL_SWE_SET must be auto, small or full, got {choice!r}")
    specs = {"auto": (B.FULL, B.SMALL), "small": (B.SMALL,), "full": (B.FULL,)}[choice]
    with _LOCK:
        for spec in specs:
            key = str(spec.path())
            if key in _CACHE:
                return _CACHE[key]
            got = B.load(spec)
            if got is not None:
                _CACHE[key] = got
                return got
        if choice == "full":
            raise FileNotFoundError(f"the full swe-v0 set is not built ({B.FULL.path()}); "
                                    "run scripts/build_swe_instances.py")
        got = B.ensure_built(B.SMALL, log=lambda *a: None)
        _CACHE[str(B.SMALL.path())] = got
        return got


def task_of(inst: Instance) -> Task:
    user = (f"{inst.issue}\n\n---\nRepository: {inst.library} {inst.version}, checked out in the working directory. "
            f"Make the failing behaviour above correct by editing the library's source, then call `submit`.")
    return Task(
        id=f"{ENV_ID}/{inst.split}/{inst.instance_id}",
        domain="swe",
        prompt=(Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=user)),
        public={"library": inst.library, "version": inst.version},
        private={"variant": inst.function, "instance_id": inst.instance_id, "library": inst.library,
                 "version": inst.version, "mutation": dataclasses.asdict(inst.mutation),
                 "fail_to_pass": list(inst.fail_to_pass), "pass_to_pass": list(inst.pass_to_pass),
                 "hidden": [dataclasses.asdict(h) for h in inst.hidden]},
        limits=LIMITS,
        thinking="high",
        split=inst.split,
    )


def make_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; splits are: train, heldout")
    import random

    pool = sorted((i for i in instance_set() if i.split == split), key=lambda i: i.instance_id)
    random.Random(f"{ENV_ID}:{split}:{seed}").shuffle(pool)
    return [task_of(i) for i in pool[: len(pool) if n is None else n]]
