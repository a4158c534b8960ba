"""Grading a swe-v0 episode: the agent's library edits, validated, on a clean tree, in a fresh sandbox.

Steps (after `kill_all` of the agent's sandbox):
1. Read what the agent left *as data* (`list_artifacts` / `read_artifact`: no symlinks, regular
   files, size caps). Only library files count (`Library.is_library_path`: `.py` under a package
   directory, not a test, not conftest / sitecustomize / usercustomize); a library file of the
   starting repo that is gone (or became a symlink) counts as deleted. Every other change (tests,
   conftest.py, pytest.ini, setup.cfg, .pth files, a fake pytest) is ignored and counted in the
   `ignored_edits` metric. A new `.py` file in the package is dropped (`new_files_dropped`).
2. Validate the edits (editcheck.py). A rejected edit is not run: the verdict says so
   (`edit_rejected` = 1, with the rules broken as metrics) and resolves nothing. An accepted
   edit is reduced to function bodies: each changed library file is replaced by
   `editcheck.splice(start, agent)`, the starting file with the agent's functions put in place,
   so none of the agent's import-time code (annotations, decorators, class bodies ...) runs.
3. Build the grading tree: the package and test directories with the original tests (hidden
   FAIL_TO_PASS tests included) rewritten to report values instead of asserting, literal
   operands removed (observe.py), the buggy library, the agent's spliced library files on top,
   and a few *canary* tests with fresh random names appended to the test files that hold
   FAIL_TO_PASS tests: each asserts something false, so an honest run reports it failed.
4. Run the suite with `runner.driver_argv` in a *pristine* sandbox (`open_pristine`) that sees
   only the allowlisted host files (mounts.py); the judge gets a fresh key on stdin and the
   result file must carry its MAC under that key.
5. resolved = every FAIL_TO_PASS and every PASS_TO_PASS test reported the values the pristine
   library reports (`observe.Reference`, computed in sandboxes of its own, compared here), the
   run is believable, and no canary passed. A run that produced no believable result (crash, timeout, the judge
   refusing the worker's reports) resolves nothing (`suite_crashed`); a forged result file or a
   canary that passed, or an operation the worker's audit hook refused to library code (frames,
   heap walks, tracing, processes, raw fds) is tampering (`tampered`, with `result_forged` /
   `canary_passed` / `runtime_denied`).

What the grader trusts, and why: the host-side code here, in editcheck.py and observe.py (never
runs agent code), the sandbox (envs/sandbox/), the reference runs (pristine library, no agent
code), and the judge process (runner.py: no library code runs in it, it holds the key). The
worker's values are compared, not believed; its reports count only as far as the judge checks
them, and a canary's pass is proof that they were forged.
"""
from __future__ import annotations

import logging
import random
import secrets
from dataclasses import dataclass
from typing import Mapping, Sequence

from envs.sandbox.base import Sandbox, SandboxBackend, SandboxLimits
from envs.swe import editcheck as E
from envs.swe import libraries as L
from envs.swe import mounts as M
from envs.swe import observe as O
from envs.swe.runner import TEST_ENV, SuiteResult, driver_argv, key_line, new_key

log = logging.getLogger(__name__)

RUNTIME_INSIDE = M.RUNTIME_INSIDE
MAX_AGENT_FILE_BYTES = 2 << 20
GRADE_LIMITS = SandboxLimits(workdir_mb=64, tmp_mb=64, max_procs=64, address_space_mb=2048, file_size_mb=32,
                             cpu_seconds=60, open_files=256, max_output_bytes=256 * 1024)
GRADE_TIMEOUT_S = 90.0
N_CANARIES = 2
MAX_RESULT_BYTES = 32 << 20


@dataclass(frozen=True)
class AgentEdits:
    library_files: Mapping[str, bytes]  # every library file as the agent left it (absent: deleted)
    applied: tuple[str, ...]  # library files that differ from the starting repo (changed, deleted)
    ignored: tuple[str, ...]  # other files the agent added or changed: not applied
    dropped: tuple[str, ...] = ()  # new .py files in the package: not applied


def collect_edits(lib: L.Library, start: Mapping[str, bytes], agent: Sandbox) -> AgentEdits:
    listed = set(agent.list_artifacts())
    lib_files: dict[str, bytes] = {}
    applied, ignored, dropped = [], [], []
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
            if p not in start:
                # A new module is new code that runs when imported; a fix does not need one.
                if data is not None:
                    dropped.append(p)
                continue
            if data is not None:
                lib_files[p] = data
            if data != start.get(p):
                applied.append(p)
        elif data != start.get(p) and (data is not None or p in start):
            ignored.append(p)
    return AgentEdits(lib_files, tuple(applied), tuple(ignored), tuple(dropped))


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
    dropped: tuple[str, ...] = ()
    rejections: tuple[E.Rejection, ...] = ()  # non-empty: the edit was rejected and not run
    result_forged: bool = False
    canary_passed: int = 0
    denied: int = 0  # operations library code attempted that the worker's audit hook refused

    @property
    def tampered(self) -> bool:
        return self.result_forged or self.canary_passed > 0 or self.denied > 0

    def checks(self) -> dict[str, float]:
        rules = {r.rule for r in self.rejections}
        return {"resolved": float(self.resolved),
                "f2p_fraction": self.f2p_passed / self.f2p_total if self.f2p_total else 0.0,
                "p2p_broken": float(self.p2p_failed),
                "p2p_broken_fraction": self.p2p_failed / self.p2p_total if self.p2p_total else 0.0,
                "suite_crashed": float(not self.suite_ok and not self.rejections),
                "applied_edits": float(len(self.applied)), "ignored_edits": float(len(self.ignored)),
                "new_files_dropped": float(len(self.dropped)),
                "edit_rejected": float(bool(self.rejections)),
                **{f"edit_rejected_{rule}": float(rule in rules) for rule in E.RULES},
                "tampered": float(self.tampered), "result_forged": float(self.result_forged),
                "canary_passed": float(self.canary_passed), "runtime_denied": float(self.denied),
                "grade_suite_s": self.suite_s}


# ----------------------------------------------------------------------------- canaries
_CANARY_WORDS = ("roundtrip", "empty_input", "large_values", "nested", "unicode", "default_key", "negative",
                 "ordering", "identity", "repeated", "single_item", "mixed_types", "boundary", "none_value")


@dataclass(frozen=True)
class Canaries:
    """Tests the grader appended (node ids), each of which fails when the suite really runs."""

    node_ids: tuple[str, ...]
    files: tuple[str, ...]


def add_canaries(tree: dict[str, bytes], f2p: Sequence[str], n: int = N_CANARIES,
                 rng: random.Random | None = None) -> Canaries:
    """Append `n` always-failing test functions with fresh names to the test files of `f2p` (in place).

    Fresh per grading and hidden from the agent, so an edit cannot tell them from the hidden
    FAIL_TO_PASS tests it is trying to make pass, other than by running them honestly."""
    rng = rng or random.Random(secrets.randbits(64))
    files = sorted({nid.split("::")[0] for nid in f2p if nid.split("::")[0] in tree})
    ids, used = [], set()
    for i in range(n if files else 0):
        path = files[i % len(files)]
        text = tree[path].decode("utf-8", "replace")
        while True:
            name = f"test_{rng.choice(_CANARY_WORDS)}_{rng.randrange(16 ** 6):06x}"
            if name not in used and f"def {name}" not in text:
                break
        used.add(name)
        a = rng.randrange(1, 10 ** 6)
        b = a + rng.randrange(1, 10 ** 3)
        body = f"\n\ndef {name}():\n    assert {a} == {b}\n"
        tree[path] = (text.rstrip("\n") + "\n" + body).encode("utf-8")
        ids.append(f"{path}::{name}")
    return Canaries(tuple(ids), tuple(files))


def canaries_passed(result: SuiteResult, canaries: Canaries) -> int:
    """Canaries that did not fail although their file ran: passed, xpassed, or left out while
    other tests of the same file have outcomes."""
    n = 0
    for nid in canaries.node_ids:
        path = nid.split("::")[0]
        got = result.outcomes.get(nid)
        if got in ("passed", "xpassed"):
            n += 1
        elif got is None and any(k.startswith(path + "::") for k in result.outcomes) \
                and path not in result.collect_errors:
            n += 1
    return n


# ----------------------------------------------------------------------------- the run
def run_in_sandbox(backend: SandboxBackend, lib: L.Library, tree: Mapping[str, bytes], *,
                   limits: SandboxLimits = GRADE_LIMITS, timeout_s: float = GRADE_TIMEOUT_S,
                   pristine: bool = True) -> SuiteResult:
    """Run the whole suite on `tree` in a fresh sandbox; `ok=False` if no believable result came back."""
    out = f".swe-result-{secrets.token_hex(8)}.json"
    if pristine:  # a fresh root; nothing of the agent's sandbox but the tree given here
        sb = M.open_pristine(backend, limits=limits, files=dict(tree))
    else:
        sb = M.open_sandbox(backend, limits=limits, files=dict(tree))
    try:
        key = new_key()
        argv = driver_argv(lib, python=str(L.interpreter()), runtime=RUNTIME_INSIDE, repo=sb.workdir_inside,
                           out=f"{sb.workdir_inside}/{out}")
        r = sb.run(argv, timeout_s=timeout_s, env=TEST_ENV, cwd=sb.workdir_inside, stdin=key_line(key))
        tail = (r.stdout + r.stderr)[-3000:]
        try:
            data = sb.read_artifact(out, max_bytes=MAX_RESULT_BYTES)
        except Exception:  # noqa: BLE001 - no result file (or a symlink, a FIFO): the run crashed or was killed
            data = None
        res = SuiteResult.read(data, key, exit_code=r.exit_code, duration_s=r.duration_s, timed_out=r.timed_out,
                               output_tail=tail)
        if res.problem:
            log.info("swe grading of %s: no believable result: %s", lib.key, res.problem)
        return res
    finally:
        sb.close()


def grade(backend: SandboxBackend, lib: L.Library, start: Mapping[str, bytes], edits: AgentEdits,
          tree: dict[str, bytes], f2p: Sequence[str], p2p: Sequence[str], *,
          limits: SandboxLimits = GRADE_LIMITS) -> SweVerdict:
    """Validate `edits`, add canaries to `tree` (the grading tree with the edits applied), run, decide."""
    check = E.check_edits(lib, start, edits.library_files)
    if not check.ok:
        log.info("swe edit rejected: %s", "; ".join(r.render() for r in check.rejections[:5]))
        return SweVerdict(False, 0, len(f2p), 0, len(p2p), suite_ok=False, applied=edits.applied,
                          ignored=edits.ignored, dropped=edits.dropped, rejections=check.rejections)
    for path, data in check.graded.items():  # what runs is the splice, never the agent's file itself
        tree[path] = data
    ref = O.reference(backend, lib)  # the pristine library's values, from its own sandbox (cached)
    tree = O.transform_tree(lib, tree)  # the tests report values; what they compare with stays here (blind.py)
    canaries = add_canaries(tree, f2p)
    result = run_in_sandbox(backend, lib, tree, limits=limits)
    return verdict(result, f2p, p2p, edits, canaries, ref)


def verdict(result: SuiteResult, f2p: Sequence[str], p2p: Sequence[str], edits: AgentEdits | None = None,
            canaries: Canaries | None = None, reference: O.Reference | None = None) -> SweVerdict:
    """With `reference`, a test passes when its reported values equal the reference's (observe.py);
    without, when the worker reported it passed (build time, the agent's own runs)."""
    common = dict(applied=edits.applied if edits else (), ignored=edits.ignored if edits else (),
                  dropped=edits.dropped if edits else (), suite_s=result.duration_s,
                  result_forged=result.forged, denied=len(result.denied))
    if not result.ok:
        return SweVerdict(False, 0, len(f2p), len(p2p), len(p2p), suite_ok=False, **common)
    if reference is not None:
        f2p_bad = [n for n in f2p if not reference.passed(n, result)]
        p2p_bad = [n for n in p2p if not reference.passed(n, result)]
    else:
        f2p_bad = result.not_passed(f2p)
        p2p_bad = result.not_passed(p2p)
    canary = canaries_passed(result, canaries) if canaries is not None else 0
    if canary:
        log.warning("swe grading: %d canary test(s) did not fail: the reports were forged", canary)
    if result.denied:
        log.warning("swe grading: library code attempted %s", "; ".join(result.denied[:3]))
    return SweVerdict(resolved=not f2p_bad and not p2p_bad and not canary and not result.denied, f2p_passed=len(f2p) - len(f2p_bad),
                      f2p_total=len(f2p), p2p_failed=len(p2p_bad), p2p_total=len(p2p), suite_ok=True,
                      canary_passed=canary, **common)
