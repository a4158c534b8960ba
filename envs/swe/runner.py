"""Running a library's test suite the same way at build time, in the agent's sandbox and at grading.

The suite always runs through `driver.py` (the `DRIVER_SOURCE` below, installed in the test
runtime by `libraries.ensure_runtime`) under the project's base interpreter with

    python -B -s -S -P driver.py --site <pytest runtime> --import-root <repo[/src]> --rootdir <repo> ...

* `-S`: no `site` import, so no `.pth` file and no `sitecustomize` / `usercustomize` runs;
  `-s`: no user site; `-P`: the script's directory is not put on sys.path; `-B`: no bytecode.
  (`-I` would also drop PYTHON* variables such as PYTHONHASHSEED, which we set on purpose; the
  environment is passed explicitly instead, so the agent cannot add to it.)
* The driver imports pytest from the runtime *before* the repository goes on sys.path, so a
  `pytest.py` or `_pytest/` in the repository cannot stand in for it.
* pytest gets `-p no:cacheprovider --noconftest -c /dev/null --rootdir <repo>`: no cache
  directory, no `conftest.py` anywhere has an effect, and no `pytest.ini` / `setup.cfg` /
  `tox.ini` / `pyproject.toml` configures the run.
* A small plugin records each test's outcome, the failure's exception text and last traceback
  frames (for issue text), and where each test function is defined (for hiding tests), and
  writes them as JSON to `--out` at the end. A process that dies before the end writes nothing:
  the caller sees no results, never a pass.

What this does not stop: code in the library under test runs inside the pytest process, so a
library edit that monkeypatches pytest at import could forge outcomes. Grading limits what an
agent can change (library `.py` files only) but does not detect such code.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from envs.swe.libraries import Library

# The environment of every test run (build, agent `run_tests`, grading): fixed hash seed so set
# iteration order cannot differ between the validation runs and the grading run.
TEST_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}

DRIVER_SOURCE = r'''"""jointrl swe-v0 test driver: runs pytest with a result-recording plugin (see envs/swe/runner.py)."""
import argparse
import inspect
import dataclasses
import json
import os
import resource
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", required=True)
    ap.add_argument("--import-root", required=True)
    ap.add_argument("--rootdir", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--deselect", action="append", default=[])
    ap.add_argument("--verbose-report", action="store_true")
    ap.add_argument("selectors", nargs="*")
    a = ap.parse_args()
    sys.path.insert(0, a.site)
    import pytest  # from the runtime, before the repository is importable

    sys.path.insert(0, a.import_root)
    root = os.path.realpath(a.rootdir)

    def rel(p):
        p = os.path.realpath(str(p))
        return os.path.relpath(p, root) if p.startswith(root + os.sep) else "<outside>/" + os.path.basename(p)

    class Recorder:
        def __init__(self):
            self.outcomes, self.failures, self.locations, self.collect_errors = {}, {}, {}, []

        def pytest_collection_modifyitems(self, items):
            for it in items:
                fn = getattr(it, "obj", None)
                try:
                    fn = inspect.unwrap(getattr(fn, "__func__", fn))
                    code = fn.__code__
                    self.locations[it.nodeid] = [rel(code.co_filename), code.co_firstlineno]
                except Exception:
                    pass

        def pytest_collectreport(self, report):
            if report.failed:
                self.collect_errors.append({"nodeid": report.nodeid, "message": str(report.longrepr)[-3000:]})

        def pytest_runtest_makereport(self, item, call):
            if call.excinfo is not None and call.when in ("setup", "call") and item.nodeid not in self.failures:
                ei = call.excinfo
                frames = [[rel(e.path), e.lineno + 1, e.name] for e in list(ei.traceback)[-4:]]
                self.failures[item.nodeid] = {"when": call.when, "message": ei.exconly()[:2000], "frames": frames}
            return None

        def pytest_runtest_logreport(self, report):
            nid = report.nodeid
            if report.when == "call":
                if hasattr(report, "wasxfail"):
                    outcome = "xfailed" if report.skipped else "xpassed"
                else:
                    outcome = report.outcome
                if self.outcomes.get(nid) != "error":
                    self.outcomes[nid] = outcome
            elif report.failed:
                self.outcomes[nid] = "error"
            elif report.skipped and report.when == "setup":
                self.outcomes[nid] = "skipped"

    rec = Recorder()
    args = list(a.selectors) + ["-p", "no:cacheprovider", "--noconftest", "-c", "/dev/null", "--rootdir", root,
                                "-q", "--tb=short", "-rfE", "-W", "ignore"]
    for d in a.deselect:
        args += ["--deselect", d]
    code = pytest.main(args, plugins=[rec])
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"exit_code": int(code), "outcomes": rec.outcomes, "failures": rec.failures,
                       "locations": rec.locations, "collect_errors": rec.collect_errors}, f)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
'''


@dataclass(frozen=True)
class Failure:
    """Why one test failed: the exception text (with pytest's assertion explanation) and the last
    traceback frames as (path relative to the repo, line, function)."""

    message: str
    frames: tuple[tuple[str, int, str], ...]
    when: str = "call"


@dataclass(frozen=True)
class SuiteResult:
    """One suite run. `outcomes`: node id -> passed / failed / error / skipped / xfailed / xpassed.
    `ok` is False when the driver wrote no results (crash, kill, timeout)."""

    ok: bool
    outcomes: Mapping[str, str] = field(default_factory=dict)
    failures: Mapping[str, Failure] = field(default_factory=dict)
    locations: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    collect_errors: tuple[str, ...] = ()
    exit_code: int = 0
    timed_out: bool = False
    duration_s: float = 0.0
    output_tail: str = ""
    cpu_s: float = 0.0  # user + system CPU of the run (local runs only; 0 when unknown)

    def passed(self) -> frozenset[str]:
        return frozenset(k for k, v in self.outcomes.items() if v == "passed")

    def not_passed(self, ids: Sequence[str]) -> list[str]:
        return [i for i in ids if self.outcomes.get(i) != "passed"]

    @staticmethod
    def from_json(data: bytes | str, *, exit_code: int, duration_s: float, timed_out: bool = False,
                  output_tail: str = "") -> "SuiteResult":
        d = json.loads(data)
        if not isinstance(d, dict) or not isinstance(d.get("outcomes"), dict):
            raise ValueError("driver result is not an object with 'outcomes'")
        fails = {k: Failure(message=str(v.get("message", "")), when=str(v.get("when", "call")),
                            frames=tuple((str(p), int(n), str(f)) for p, n, f in v.get("frames", ())))
                 for k, v in d.get("failures", {}).items()}
        locs = {k: (str(v[0]), int(v[1])) for k, v in d.get("locations", {}).items()}
        return SuiteResult(ok=True, outcomes={str(k): str(v) for k, v in d["outcomes"].items()}, failures=fails,
                           locations=locs, collect_errors=tuple(str(e.get("nodeid", "")) for e in d.get("collect_errors", ())),
                           exit_code=exit_code, timed_out=timed_out, duration_s=duration_s, output_tail=output_tail)


def driver_argv(lib: Library, *, python: str, runtime: str, repo: str, out: str | None,
                selectors: Sequence[str] = (), deselect: Sequence[str] = ()) -> list[str]:
    """The argv of one suite run. Paths are as seen by the process (host paths or sandbox paths)."""
    import_root = repo if not lib.import_root else f"{repo}/{lib.import_root}"
    argv = [python, "-B", "-s", "-S", "-P", f"{runtime}/driver.py", "--site", f"{runtime}/site",
            "--import-root", import_root, "--rootdir", repo]
    if out is not None:
        argv += ["--out", out]
    for d in tuple(lib.deselect) + tuple(deselect):
        argv += ["--deselect", d]
    sels = list(selectors) or list(lib.test_dirs)
    for s in sels:
        if s.startswith("-"):
            raise ValueError(f"test selector {s!r} must be a path or node id, not an option")
    return argv + ["--"] + sels


def run_suite_local(lib: Library, tree: Path, runtime: Path, python: Path, *, timeout_s: float = 120.0,
                    selectors: Sequence[str] = ()) -> SuiteResult:
    """Build-time run in a plain subprocess (our own trusted mutations, no agent code): the same
    driver and flags as in the sandbox, so outcomes agree with grading."""
    with tempfile.TemporaryDirectory(prefix="swe-out-") as td:
        out = os.path.join(td, "result.json")
        argv = driver_argv(lib, python=str(python), runtime=str(runtime), repo=str(tree), out=out, selectors=selectors)
        t0 = time.monotonic()
        # CPU time, not wall time, decides "fast enough": on a shared machine wall time is noise.
        # RUSAGE_CHILDREN counts waited-for children; one suite runs at a time per process.
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            p = subprocess.run(argv, cwd=tree, env=TEST_ENV, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or b"")[-2000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-2000:]
            return SuiteResult(ok=False, timed_out=True, duration_s=time.monotonic() - t0, output_tail=str(tail))
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        dt = time.monotonic() - t0
        tail = (p.stdout + p.stderr)[-3000:]
        if not os.path.exists(out):
            return SuiteResult(ok=False, exit_code=p.returncode, duration_s=dt, output_tail=tail, cpu_s=cpu)
        with open(out, "rb") as f:
            r = SuiteResult.from_json(f.read(), exit_code=p.returncode, duration_s=dt, output_tail=tail)
        return dataclasses.replace(r, cpu_s=cpu)


def summarize(res: SuiteResult) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for v in res.outcomes.values():
        counts[v] = counts.get(v, 0) + 1
    return counts
