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
import logging
import os
import threading
from typing import Any, Callable, Generic, TypeVar

from envs.swe import build as B
from envs.swe.build import Instance
from jointrl.records import Limits, Message, Task

ENV_ID = "swe-v0"
T = TypeVar("T")
log = logging.getLogger(__name__)
LIMITS = Limits(max_turns=40, tool_timeout_s=90.0, episode_timeout_s=1200.0, max_obs_chars=6000, max_arg_chars=60_000)

SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a Python library. The repository is checked out in your "
    "working directory (a git repository with a single commit) inside a sandbox without network access. "
    "Tools: `bash` (a shell in the repository), `view` (read a file with line numbers, or list a directory), "
    "`str_replace` (replace one exact, unique occurrence of a string in a file), `run_tests` (run the "
    "repository's tests with pytest, optionally only some of them) and `submit` (finish). Fix the library code "
    "so that the behaviour described in the issue is correct; do not edit the tests. Your change is graded "
    "with the project's full test suite, including tests you cannot see.")

class InstanceSets(Generic[T]):
    """One SWE rung's instance sets: the full set if built, else the small one (built at first use), as
    `JOINTRL_SWE_SET` (auto | small | full) chooses; `full` raises if it is not built. Each set is read
    once per process. swe-v0 (here) and swe-onefunc-v0 (envs/swe/onefunc.py) each hold one."""

    def __init__(self, env_id: str, full: Any, small: Any, load: Callable[[Any], list[T] | None],
                 ensure_built: Callable[[Any], list[T]], build_hint: str, *, warn_small: bool = False) -> None:
        self.env_id, self.full, self.small, self.load, self.ensure_built = env_id, full, small, load, ensure_built
        self.build_hint, self.warn_small = build_hint, warn_small
        self._lock = threading.Lock()
        self._cache: dict[str, list[T]] = {}

    def get(self) -> list[T]:
        choice = os.environ.get("JOINTRL_SWE_SET", "auto")
        if choice not in ("auto", "small", "full"):
            raise ValueError(f"JOINTRL_SWE_SET must be auto, small or full, got {choice!r}")
        specs = {"auto": (self.full, self.small), "small": (self.small,), "full": (self.full,)}[choice]
        with self._lock:
            for spec in specs:
                key = str(spec.path())
                if key in self._cache:
                    return self._cache[key]
                got = self.load(spec)
                if got is None and spec is self.full:
                    if choice == "full":
                        raise FileNotFoundError(f"the full {self.env_id} set is not built ({self.full.path()}); run {self.build_hint}")
                    continue
                if spec is self.small and choice == "auto" and self.warn_small:
                    log.warning("%s: the full instance set is not built (%s); using the small set (%d train + %d held-out "
                                "tasks)", self.env_id, self.build_hint, self.small.n_train, self.small.n_heldout)
                self._cache[key] = got if got is not None else self.ensure_built(spec)
                return self._cache[key]
        raise AssertionError("unreachable: the small set is always built")


_SETS: InstanceSets[Instance] = InstanceSets(ENV_ID, B.FULL, B.SMALL, B.load, lambda spec: B.ensure_built(spec, log=lambda *a: None),
                                             "scripts/build_swe_instances.py")


def instance_set() -> list[Instance]:
    """The full set if built, else the small one (built now if missing); see `InstanceSets`."""
    return _SETS.get()


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
