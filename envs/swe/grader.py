"""Grading a swe-v0 episode: the agent's library edits, original tests, a fresh sandbox, hidden tests.

Steps (after `kill_all` of the agent's sandbox):
1. Read what the agent left *as data* (`list_artifacts` / `read_artifact`: no symlinks, regular
   files, size caps). Only library files count (`Library.is_library_path`: `.py` under a package
   directory, not a test, not conftest / sitecustomize / usercustomize); a library file of the
   starting repo that is gone (or became a symlink) counts as deleted. Every other change (tests,
   conftest.py, pytest.ini, setup.cfg, .pth files, a fake pytest) is ignored and counted in the
   `ignored_edits` metric.
2. Build the grading tree: the package and test directories with the original tests (hidden
   FAIL_TO_PASS tests included), the buggy library, the agent's library files on top.
3. Run the suite with `runner.driver_argv` in a *pristine* sandbox (`open_pristine`): its root is
   the host's read-only /usr, pytest comes from the read-only runtime mount, the interpreter from
   its own read-only mount, and nothing from the agent's sandbox is mounted.
4. resolved = every FAIL_TO_PASS and every PASS_TO_PASS test passed. A run that produced no
   results (crash, timeout) resolves nothing; that is the agent's failure, reported in the
   `suite_crashed` metric, not a grading error.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Mapping, Sequence

from envs.sandbox.base import Mount, Sandbox, SandboxBackend, SandboxLimits
from envs.swe import libraries as L
from envs.swe.runner import TEST_ENV, SuiteResult, driver_argv

RUNTIME_INSIDE = "/opt/swe"
MAX_AGENT_FILE_BYTES = 2 << 20
GRADE_LIMITS = SandboxLimits(workdir_mb=64, tmp_mb=64, max_procs=64, address_space_mb=2048, file_size_mb=32,
                             cpu_seconds=60, open_files=256, max_output_bytes=256 * 1024)
GRADE_TIMEOUT_S = 90.0


def test_mounts() -> tuple[Mount, ...]:
    """The read-only mounts a test run needs: the pytest runtime and (if not under /usr) the interpreter."""
    mounts = [Mount(host=L.ensure_runtime(), inside=RUNTIME_INSIDE)]
    root = L.interpreter_mount_root()
    if root is not None:
        mounts.append(Mount(host=root, inside=str(root)))
    return tuple(mounts)


@dataclass(frozen=True)
class AgentEdits:
    library_files: Mapping[str, bytes]  # every library file as the agent left it (absent: deleted)
    applied: tuple[str, ...]  # library files that differ from the starting repo (added, changed, deleted)
    ignored: tuple[str, ...]  # other files the agent added or changed: not applied


def collect_edits(lib: L.Library, start: Mapping[str, bytes], agent: Sandbox) -> AgentEdits:
    listed = set(agent.list_artifacts())
    lib_files: dict[str, bytes] = {}
    applied, ignored = [], []
    for p in sorted(listed | set(start)):
        if p.startswith(".git/"):
            continue
        data = None
        if p in listed:
            try:
                data = agent.read_artifact(p, max_bytes=MAX_AGENT_FILE_BYTES)
            except Exception:  # noqa: BLE001 - a symlink, a special or oversize file is not a valid edit
                data = None
        if lib.is_library_path(p):
            if data is not None:
                lib_files[p] = data
            if data != start.get(p):
                applied.append(p)
        elif data != start.get(p) and (data is not None or p in start):
            ignored.append(p)
    return AgentEdits(lib_files, tuple(applied), tuple(ignored))


@dataclass(frozen=True)
class SweVerdict:
    resolved: bool
    f2p_passed: int
    f2p_total: int
    p2p_failed: int
    p2p_total: int
    suite_ok: bool
    applied: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    suite_s: float = 0.0

    def checks(self) -> dict[str, float]:
        return {"resolved": float(self.resolved),
                "f2p_fraction": self.f2p_passed / self.f2p_total if self.f2p_total else 0.0,
                "p2p_broken": float(self.p2p_failed),
                "p2p_broken_fraction": self.p2p_failed / self.p2p_total if self.p2p_total else 0.0,
                "suite_crashed": float(not self.suite_ok),
                "applied_edits": float(len(self.applied)), "ignored_edits": float(len(self.ignored)),
                "grade_suite_s": self.suite_s}


def run_in_sandbox(backend: SandboxBackend, lib: L.Library, tree: Mapping[str, bytes], *,
                   limits: SandboxLimits = GRADE_LIMITS, timeout_s: float = GRADE_TIMEOUT_S,
                   pristine: bool = True) -> SuiteResult:
    """Run the whole suite on `tree` in a fresh sandbox; `ok=False` if it produced no results."""
    out = f".swe-result-{secrets.token_hex(8)}.json"
    if pristine:  # a fresh root; nothing of the agent's sandbox but the tree given here
        sb = backend.open_pristine(agent=None, files=dict(tree), limits=limits, mounts=test_mounts())
    else:
        sb = backend.open(limits=limits, files=dict(tree), mounts=test_mounts())
    try:
        argv = driver_argv(lib, python=str(L.interpreter()), runtime=RUNTIME_INSIDE, repo=sb.workdir_inside,
                           out=f"{sb.workdir_inside}/{out}")
        r = sb.run(argv, timeout_s=timeout_s, env=TEST_ENV, cwd=sb.workdir_inside)
        tail = (r.stdout + r.stderr)[-3000:]
        try:
            data = sb.read_artifact(out, max_bytes=32 << 20)
            return SuiteResult.from_json(data, exit_code=r.exit_code, duration_s=r.duration_s, timed_out=r.timed_out,
                                         output_tail=tail)
        except Exception:  # noqa: BLE001 - no (valid) result file: the run crashed or was killed
            return SuiteResult(ok=False, exit_code=r.exit_code, timed_out=r.timed_out, duration_s=r.duration_s,
                               output_tail=tail)
    finally:
        sb.close()


def verdict(result: SuiteResult, f2p: Sequence[str], p2p: Sequence[str], edits: AgentEdits | None = None) -> SweVerdict:
    if not result.ok:
        return SweVerdict(False, 0, len(f2p), len(p2p), len(p2p), suite_ok=False,
                          applied=edits.applied if edits else (), ignored=edits.ignored if edits else (),
                          suite_s=result.duration_s)
    f2p_bad = result.not_passed(f2p)
    p2p_bad = result.not_passed(p2p)
    return SweVerdict(resolved=not f2p_bad and not p2p_bad, f2p_passed=len(f2p) - len(f2p_bad), f2p_total=len(f2p),
                      p2p_failed=len(p2p_bad), p2p_total=len(p2p), suite_ok=True,
                      applied=edits.applied if edits else (), ignored=edits.ignored if edits else (),
                      suite_s=result.duration_s)
