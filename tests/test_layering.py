"""The project's import graph: every module imports alone, and the layers point one way.

    rl -> envs -> rewards -> jointrl
    rl -> model ----------> jointrl

`jointrl` (shared records and paths) is the leaf; `model` and `rewards` import neither `envs` nor
`rl`; `envs` does not import `rl` or `model`.

Inside `rl`, its subpackages point one way too (`RL_ALLOWED`):

    algos, weights, observe          leaves: the math, the weight formats and transports, metrics
    rollout, trainer                 each on the leaves, never on each other
    serve, jobs                      services on rollout and the leaves
    tinker                           the training service, on trainer, rollout and serve

The top-level modules of `rl` (the driver, its config and shared records) may import any subpackage. The direction check reads every import statement of
every module, function-level (lazy) imports included, so a cycle cannot hide behind a late import.
The import-alone check imports each module in a process of its own that has loaded no project module
before it, so an order-dependent import (one that works only because a test imported something else
first) fails here.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

PACKAGES = ("jointrl", "rewards", "model", "envs", "rl")
# What each package may import from the project (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "jointrl": frozenset(),
    "rewards": frozenset({"jointrl"}),
    "model": frozenset({"jointrl"}),
    "envs": frozenset({"jointrl", "rewards"}),
    "rl": frozenset({"jointrl", "rewards", "model", "envs"}),
}


_LEAVES = frozenset({"algos", "weights", "observe"})
# What each subpackage of rl may import from the others (a new subpackage must be placed here).
RL_ALLOWED: dict[str, frozenset[str]] = {
    "algos": frozenset(),
    "weights": frozenset(),
    "observe": frozenset(),
    "rollout": _LEAVES,
    "trainer": _LEAVES,
    "serve": _LEAVES | {"rollout"},
    "jobs": _LEAVES | {"rollout"},
    "tinker": _LEAVES | {"rollout", "trainer", "serve"},
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append((".".join(parts), path))
    return out


MODULES = _modules()


def _project_imports(module: str, path: Path, depth: int = 1) -> list[tuple[int, str]]:
    """(line, project package) for every import in the file, relative ones resolved; the package is the
    imported name's first `depth` parts (2: `rl.rollout` for `rl.rollout.engine`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        if isinstance(node, ast.ImportFrom) and depth > 1:  # `from rl import rollout` imports rl.rollout
            names = [f"{names[0]}.{a.name}" if names[0] else a.name for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] in PACKAGES:
                found.append((node.lineno, ".".join(parts[:depth])))
    return sorted(found)


def _violations(module: str, path: Path) -> list[str]:
    own = module.split(".")[0]
    return [f"{path.name}:{line}: {own} imports {top}" for line, top in _project_imports(module, path)
            if top != own and top not in ALLOWED[own]]


def _rl_subpackage(module: str) -> str | None:
    """`rollout` for `rl.rollout.engine` (and for `rl.rollout` itself); None for a top-level module of rl."""
    parts = module.split(".")
    if parts[0] != "rl" or len(parts) < 2 or not (REPO / "rl" / parts[1]).is_dir():
        return None
    return parts[1]


def _rl_violations(module: str, path: Path) -> list[str]:
    own = _rl_subpackage(module)
    if own is None:
        return []
    out = []
    for line, name in _project_imports(module, path, depth=2):
        other = _rl_subpackage(name)
        if other is not None and other != own and other not in RL_ALLOWED.get(own, frozenset()):
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
            out.append(f"{where}:{line}: rl.{own} imports rl.{other}")
    return out


def test_every_package_is_covered():
    tops = {m.split(".")[0] for m, _ in MODULES}
    assert tops == set(PACKAGES)
    assert len(MODULES) > 100  # the walk found the tree, not an empty folder


def test_no_import_points_against_the_layers():
    bad = [v for module, path in MODULES for v in _violations(module, path)]
    assert not bad, "imports against the layer direction:\n" + "\n".join(bad)


def test_every_rl_subpackage_is_placed():
    subs = {p.name for p in (REPO / "rl").iterdir() if (p / "__init__.py").is_file()}
    assert subs == set(RL_ALLOWED), f"place {sorted(subs - set(RL_ALLOWED))} in RL_ALLOWED (or drop {sorted(set(RL_ALLOWED) - subs)})"


def test_no_import_points_against_the_rl_subpackage_directions():
    bad = [v for module, path in MODULES for v in _rl_violations(module, path)]
    assert not bad, "imports against the rl subpackage directions:\n" + "\n".join(bad)


def test_the_rl_direction_check_reads_subpackages_and_lazy_imports(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from rl.weights import names\n\ndef late():\n    from rl.rollout.engine import RolloutEngine\n"
                 "from rl import config\nfrom . import batch\n")
    assert _rl_violations("rl.trainer.x", f) == ["x.py:4: rl.trainer imports rl.rollout"]
    assert _rl_violations("rl.serve.x", f) == [] and _rl_violations("rl.x", f) == []  # serve may; top-level modules are free
    assert _rl_subpackage("rl.rollout.engine") == "rollout" and _rl_subpackage("rl.config") is None
    assert [n for _, n in _project_imports("rl.trainer.x", f, depth=2)] == ["rl.weights", "rl.rollout", "rl.config", "rl.trainer"]


def test_the_direction_check_sees_lazy_and_relative_imports(tmp_path):
    # The checker itself, on a file written to break both rules in ways a top-of-file scan would miss.
    f = tmp_path / "x.py"
    f.write_text("import os\n\ndef late():\n    from rl import train\n\nfrom . import sibling\nfrom ..swe import grader\n")
    assert _project_imports("envs.swe.sub.x", f) == [(4, "rl"), (6, "envs"), (7, "envs")]
    assert _violations("envs.swe.sub.x", f) == ["x.py:4: envs imports rl"]
    assert _violations("rl.x", f) == []


# Each module is imported in a child forked from one interpreter that has imported only third-party
# packages: a fresh interpreter per module spent most of its ~3 s importing torch and transformers'
# model machinery again (~300 s over the tree). What the check is about, the project's own import
# order, is untouched: no project module is loaded before the fork. The preloaded transformers
# submodules are ones `transformers` itself resolves on attribute access, so preloading them cannot
# hide a missing import either.
PRELOADED = ("numpy", "torch", "transformers", "transformers.modeling_utils", "transformers.models.auto")

_FORK_SERVER = r"""
import importlib, json, os, sys, tempfile, traceback
for name in PRELOADED:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] in PACKAGES], "a project module was loaded before the fork"
results, running, todo = {}, {}, list(sys.argv[1:])
while todo or running:
    while todo and len(running) < 2:
        module = todo.pop(0)
        err = tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:
            os.dup2(err.fileno(), 2)
            try:
                importlib.import_module(module)
                rc = 0
            except BaseException:
                traceback.print_exc()
                rc = 1
            sys.stderr.flush()
            os._exit(rc)
        running[pid] = (module, err)
    pid, status = os.wait()
    module, err = running.pop(pid)
    err.seek(0)
    results[module] = (os.waitstatus_to_exitcode(status), err.read().decode(errors="replace")[-1500:])
print(json.dumps(results))
"""


def _import_each_alone(modules: list[str], cwd: Path = REPO) -> dict[str, tuple[int, str]]:
    code = f"PRELOADED = {PRELOADED!r}\nPACKAGES = {PACKAGES!r}\n" + _FORK_SERVER
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=cwd, capture_output=True, text=True,
                          timeout=1800, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "JOINTRL_PROGRESS": "0",
                                             "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {m: (rc, err) for m, (rc, err) in json.loads(proc.stdout.splitlines()[-1]).items()}


def test_the_import_check_reports_a_module_that_needs_another_imported_first(tmp_path):
    # Two modules of a throwaway package: `b` uses `a` only through the package attribute, which exists
    # only if something imported `a` first. Alone, `b` must fail; `a` must pass.
    pkg = tmp_path / "layering_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "b.py").write_text("import layering_probe\nY = layering_probe.a.X\n")
    got = _import_each_alone(["layering_probe.a", "layering_probe.b"], cwd=tmp_path)
    assert got["layering_probe.a"][0] == 0
    assert got["layering_probe.b"][0] == 1 and "AttributeError" in got["layering_probe.b"][1]


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    results = _import_each_alone([m for m, _ in MODULES])
    assert len(results) == len(MODULES)
    failed = [f"{m} (rc {rc}):\n{err}" for m, (rc, err) in results.items() if rc != 0]
    assert not failed, f"{len(failed)} of {len(results)} modules fail to import alone:\n" + "\n\n".join(failed)
