"""From a built `Instance` (or the Task that carries it) to file trees: the agent's repository,
the grading tree, and the reference edit.

- `agent_repo(task)`: the pristine sdist tree with the bug injected and the FAIL_TO_PASS test
  functions removed from the test files (what the agent's sandbox starts with).
- `grading_tree(lib, task, agent_library_files)`: the package and test directories with the
  *original* tests, the buggy library files, and the agent's versions of library files on top.
- `reference_edit(task)`: the reverse of the injected edit as a `str_replace` (old, new) pair that
  occurs exactly once in the buggy file.

Trees are `dict[relative path, bytes]`. Pristine trees come from the cache (libraries.py).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from envs.swe import libraries as L
from envs.swe.build import HiddenSpan, apply_hidden
from envs.swe.mutate import Mutation
from jointrl.records import Task


@functools.lru_cache(maxsize=8)
def pristine(lib_name: str) -> Mapping[str, bytes]:
    lib = L.get_library(lib_name)
    return dict(L.source_files(lib, L.ensure_source(lib)))


def task_library(task: Task) -> L.Library:
    lib = L.get_library(task.private["library"])
    if lib.version != task.private["version"]:
        raise ValueError(f"task {task.id} was built for {lib.name} {task.private['version']}, "
                         f"but {lib.version} is pinned now; rebuild the instance set")
    return lib


def task_mutation(task: Task) -> Mutation:
    return Mutation(**task.private["mutation"])


def task_hidden(task: Task) -> list[HiddenSpan]:
    return [HiddenSpan(**h) for h in task.private["hidden"]]


def buggy_source(task: Task) -> tuple[str, str]:
    """(path, buggy text) of the mutated library file."""
    lib = task_library(task)
    m = task_mutation(task)
    return m.path, m.apply(pristine(lib.name)[m.path].decode("utf-8"))


def agent_repo(task: Task) -> dict[str, bytes]:
    lib = task_library(task)
    files = dict(pristine(lib.name))
    path, text = buggy_source(task)
    files[path] = text.encode("utf-8")
    spans = task_hidden(task)
    for p in {s.path for s in spans}:
        files[p] = apply_hidden(files[p].decode("utf-8"), [s for s in spans if s.path == p]).encode("utf-8")
    return files


def grading_tree(task: Task, agent_library_files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Original tests + buggy library, then every library file replaced by the agent's version
    (`agent_library_files`: library path -> bytes; a library path absent from it was deleted)."""
    lib = task_library(task)
    tree = L.grading_files(lib, dict(pristine(lib.name)))
    path, text = buggy_source(task)
    tree[path] = text.encode("utf-8")
    for p in [p for p in tree if lib.is_library_path(p)]:
        if p not in agent_library_files:
            del tree[p]
    for p, data in agent_library_files.items():
        if not lib.is_library_path(p):
            raise ValueError(f"{p!r} is not a library file of {lib.name}; it cannot enter the grading tree")
        tree[p] = data
    return tree


def reference_edit(task: Task) -> dict[str, Any]:
    """`str_replace` arguments undoing the injected edit: whole lines, widened until unique."""
    m = task_mutation(task)
    _, buggy = buggy_source(task)
    lines = buggy.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    first = m.line - 1
    last = first
    end = m.start + len(m.replacement)
    while starts[last + 1] < end:
        last += 1
    while True:
        lo, hi = starts[first], starts[last + 1]
        old = buggy[lo:hi]
        if buggy.count(old) == 1 or (first == 0 and last == len(lines) - 1):
            break
        first, last = max(0, first - 1), min(len(lines) - 1, last + 1)
    new = m.revert(buggy)[lo:hi + len(m.original) - len(m.replacement)]
    return {"path": m.path, "old": old, "new": new}
