"""swe-v0 timings side by side: suites local vs sandboxed, grading before vs after the defences, an episode.

    .venv/bin/python scripts/bench_swe.py [--repeats 3] [--before HEAD]

1. Per library (pristine source): the suite's CPU and wall time in a plain subprocess (what the
   build measures against the 10 s budget), the wall time of the same suite in a fresh pristine
   bubblewrap sandbox (what grading costs), their ratio, and whether the runner of `--before`
   (one process, in-process recorder) gives the same outcomes as the current one (judge + worker).
2. Per small-set instance, with its reference fix: grading time the `--before` way and the
   current way (`grader.grade`: edit validation and splice, tests transformed to report values,
   canaries, judge + worker, allowlisted mounts, the comparison with the cached reference, whose
   one-off build per library is timed first), interleaved, median of `--repeats`, in wall time and in CPU time (this process plus
   the sandboxes it waited for). Both must resolve. The `--before` way is that
   revision's code, read with `git show`: for a revision from before the judge/worker runner,
   its `envs/swe/runner.py` (one pytest process writing its own result, whole `/usr` and
   interpreter root mounted, no edit validation, no canaries); for a later one, its
   `runner.py`, `editcheck.py` and `grader.py` (its validation, canaries and judge + worker, with
   its own driver and worker in the runtime).
3. For one small-set task: `reset` (sandbox + repository + git commit) and a whole reference
   episode including grading.
Needs the sdists and the small set in the cache (builds them otherwise) and root for the sandbox.

    .venv/bin/python scripts/bench_swe.py --edit-sweep

instead undoes every mutation of every library (what a reference fix is, for any instance a
build could pick) and counts how many edit validation (editcheck.py) would reject: it must be 0.
No sandbox needed; ~15 min on the shared 2-core machine.

    .venv/bin/python scripts/bench_swe.py --judge-sweep [LIBRARY ...] [--per-library 25]

instead checks the value judge (observe.py) against pytest's verdict on sampled mutations
(`judge_sweep`): tests pytest fails that the judge passes must be 0, and the pristine library
must pass every test under the judge. No sandbox needed.

    .venv/bin/python scripts/bench_swe.py --blind-stats

instead counts, per library, what the transform takes out of the copy of the tests the tested
process runs (blind.py): observation operands dropped as literals and by blinding, expected-only
bindings, table columns and helper arguments cleared, and the constants (strings and numbers)
left in the test modules: original, literal operands dropped only, blinded. Static; seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from envs.sandbox.base import Mount  # noqa: E402
from envs.swe import build as B  # noqa: E402
from envs.swe import grader as G  # noqa: E402
from envs.swe import instances as I  # noqa: E402
from envs.swe import libraries as L  # noqa: E402
from envs.swe.runner import run_suite_local  # noqa: E402
from envs.swe.tasks import task_of  # noqa: E402


def _load(rev: str, rel: str, name: str, rewrite: dict[str, str]) -> ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for old, new in rewrite.items():
        src = src.replace(old, new)
    d = Path(tempfile.mkdtemp(prefix="bench-swe-"))
    (d / f"{name}.py").write_text(src)
    spec = importlib.util.spec_from_file_location(name, d / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def load_before(rev: str) -> ModuleType:
    """`envs/swe/runner.py` as it was at `rev`, imported under another name; for a revision with
    the judge/worker runner, its `editcheck` and `grader` too (as `.editcheck`, `.grader`)."""
    mod = _load(rev, "envs/swe/runner.py", "runner_before", {})
    if not hasattr(mod, "DRIVER_SOURCE"):
        mod.editcheck = _load(rev, "envs/swe/editcheck.py", "editcheck_before", {})
        mod.grader = _load(rev, "envs/swe/grader.py", "grader_before", {
            "from envs.swe import editcheck as E": "import editcheck_before as E",
            "from envs.swe.runner import": "from runner_before import"})
    return mod


def before_runtime(before: ModuleType) -> Path:
    """The current runtime's pytest with the driver (and worker) of `--before`."""
    cur = L.ensure_runtime()
    sources = {"driver.py": before.DRIVER_SOURCE} if hasattr(before, "DRIVER_SOURCE") else {
        "driver.py": before.JUDGE_SOURCE, "worker.py": before.WORKER_SOURCE}
    h = hashlib.sha256("".join(sources.values()).encode() + str(cur).encode()).hexdigest()[:12]
    dst = L.cache_root() / "bench-before-runtime" / h
    if not (dst / ".complete").exists():
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(cur, dst, ignore=shutil.ignore_patterns("driver.py", "worker.py", ".complete"))
        for name, text in sources.items():
            (dst / name).write_text(text)
        for p in [dst, *dst.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() or p.parent.name == "bin" else 0o644)
        (dst / ".complete").write_text("ok\n")
    return dst


def grade_before(backend, before: ModuleType, runtime: Path, lib: L.Library, tree, f2p, p2p, start=None,
                 lib_files=None) -> bool:
    """The grading path of `--before`."""
    if not hasattr(before, "DRIVER_SOURCE"):
        return grade_before_judge(backend, before, runtime, lib, dict(tree), f2p, p2p, start, lib_files)
    # before the judge: its driver, whole /usr and interpreter root, no validation or canaries
    base = Path(sys.base_prefix).resolve()
    mounts = [Mount(host=runtime, inside=G.RUNTIME_INSIDE)]
    if not str(base).startswith("/usr/"):
        mounts.append(Mount(host=base, inside=str(base)))
    out = f".swe-result-{secrets.token_hex(8)}.json"
    sb = backend.open_pristine(agent=None, files=dict(tree), limits=G.GRADE_LIMITS, mounts=tuple(mounts))
    try:
        argv = before.driver_argv(lib, python=str(L.interpreter()), runtime=G.RUNTIME_INSIDE,
                                  repo=sb.workdir_inside, out=f"{sb.workdir_inside}/{out}")
        r = sb.run(argv, timeout_s=G.GRADE_TIMEOUT_S, env=before.TEST_ENV, cwd=sb.workdir_inside)
        res = before.SuiteResult.from_json(sb.read_artifact(out, max_bytes=32 << 20), exit_code=r.exit_code,
                                           duration_s=r.duration_s)
    finally:
        sb.close()
    return not res.not_passed(f2p) and not res.not_passed(p2p)


def grade_before_judge(backend, before: ModuleType, runtime: Path, lib: L.Library, tree, f2p, p2p, start,
                       lib_files) -> bool:
    """A judge/worker-era revision's `grade`, with its own driver and worker mounted as the runtime."""
    from envs.swe import mounts as M

    Gb, Eb = before.grader, before.editcheck
    path = [p for p in lib_files if lib_files[p] != start.get(p)]
    edits = Gb.AgentEdits(lib_files, tuple(path), ())
    check = Eb.check_edits(lib, start, edits.library_files)
    assert check.ok, check
    canaries = Gb.add_canaries(tree, f2p)
    mounts = tuple(Mount(host=runtime, inside=m.inside) if m.inside == G.RUNTIME_INSIDE else m for m in M.test_mounts())
    out = f".swe-result-{secrets.token_hex(8)}.json"
    sb = backend.open_pristine(agent=None, files=dict(tree), limits=G.GRADE_LIMITS, mounts=mounts, **M._usr(backend))
    try:
        key = before.new_key()
        argv = before.driver_argv(lib, python=str(L.interpreter()), runtime=G.RUNTIME_INSIDE, repo=sb.workdir_inside,
                                  out=f"{sb.workdir_inside}/{out}")
        r = sb.run(argv, timeout_s=G.GRADE_TIMEOUT_S, env=before.TEST_ENV, cwd=sb.workdir_inside,
                   stdin=before.key_line(key))
        res = before.SuiteResult.read(sb.read_artifact(out, max_bytes=32 << 20), key, exit_code=r.exit_code,
                                      duration_s=r.duration_s)
    finally:
        sb.close()
    return Gb.verdict(res, f2p, p2p, edits, canaries).resolved


def cpu_now() -> float:
    """CPU seconds of this process and every child it has waited for (the sandbox and what ran in it):
    on a loaded shared machine, the cost that wall time hides behind other tenants' work."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def grade_now(backend, lib: L.Library, task, start, lib_files) -> bool:
    path = task.private["mutation"]["path"]
    edits = G.AgentEdits(lib_files, (path,), ())
    v = G.grade(backend, lib, start, edits, I.grading_tree(task, lib_files), task.private["fail_to_pass"],
                task.private["pass_to_pass"])
    return v.resolved


def edit_sweep(names=()) -> int:
    from envs.swe import editcheck as E
    from envs.swe.mutate import enumerate_mutations

    total_bad = 0
    for name in names or L.LIBRARIES:
        lib = L.get_library(name)
        files = L.source_files(lib)
        n = bad = 0
        t0 = time.monotonic()
        for path in L.mutable_files(lib, files):
            text = files[path].decode("utf-8")
            for m in enumerate_mutations(path, text):
                start = dict(files)
                start[path] = m.apply(text).encode("utf-8")
                r = E.check_edits(lib, start, {path: files[path]})
                n += 1
                if r.ok and r.graded[path] != files[path]:  # the splice of a reference fix is the release's file
                    bad += 1
                    print(f"  spliced differently: {lib.key} {m.kind} {m.function}")
                if not r.ok:
                    bad += 1
                    print(f"  rejected: {lib.key} {m.kind} {m.function}: {r.rejections[0].render()}")
        total_bad += bad
        print(f"{lib.key:<22} reference fixes {n:>5}  rejected {bad}  ({time.monotonic() - t0:.0f} s)")
    return 1 if total_bad else 0


def judge_sweep(names=(), per_library: int = 25, seed: int = 0) -> int:
    """The value judge (observe.py) against pytest's own verdict, on sampled mutations of every library.

    Per mutation, the suite runs twice in a plain subprocess (our own trusted mutations, no
    agent code): the original tests (pytest decides) and the transformed tests (the judge compares
    the reported values with the pristine library's reference). Counted over the tests that pass
    on the pristine library: `missed`, tests pytest fails but the judge passes (the judge would be
    weaker than the tests), and `extra`, tests the judge fails but pytest passes. The pristine
    library itself (what every reference fix restores) must pass every test under the judge."""
    import random

    from envs.swe import observe as O
    from envs.swe.mutate import enumerate_mutations

    runtime, python = L.ensure_runtime(), L.interpreter()

    def run(lib, tree):
        with tempfile.TemporaryDirectory() as td:
            for rel, data in tree.items():
                (Path(td) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(td) / rel).write_bytes(data)
            return run_suite_local(lib, Path(td), runtime, python, timeout_s=60)

    bad = 0
    print(f"{'library':<22}{'sampled':>8}{'ran':>5}{'caught by pytest':>18}{'caught by judge':>17}"
          f"{'tests missed':>14}{'tests extra':>13}{'pristine fails':>16}{'s':>6}")
    for name in names or L.LIBRARIES:
        lib = L.get_library(name)
        t0 = time.monotonic()
        files = L.source_files(lib)
        grading = L.grading_files(lib, files)
        ref = O.merge_runs(*[run(lib, O.transform_tree(lib, grading)).observations for _ in range(O.REFERENCE_RUNS)])
        base = run(lib, grading)
        passing = sorted(base.passed())
        pristine = run(lib, O.transform_tree(lib, grading))
        pristine_fails = [n for n in passing if not ref.passed(n, pristine)]
        muts = [(p, m) for p in L.mutable_files(lib, files) for m in enumerate_mutations(p, files[p].decode("utf-8"))]
        sample = random.Random(seed).sample(muts, min(per_library, len(muts)))
        ran = by_pytest = by_judge = missed = extra = 0
        for path, m in sample:
            tree = dict(grading)
            tree[path] = m.apply(files[path].decode("utf-8")).encode("utf-8")
            r_py, r_obs = run(lib, tree), run(lib, O.transform_tree(lib, tree))
            if not (r_py.ok and r_obs.ok):  # a crash or a timeout: no test passes either way
                continue
            ran += 1
            py_fail = {n for n in passing if r_py.outcomes.get(n) != "passed"}
            judge_fail = {n for n in passing if not ref.passed(n, r_obs)}
            by_pytest += bool(py_fail)
            by_judge += bool(judge_fail)
            missed += len(py_fail - judge_fail)
            extra += len(judge_fail - py_fail)
            if py_fail - judge_fail:
                print(f"  missed: {lib.key} {m.kind} {m.function}: {sorted(py_fail - judge_fail)[:3]}")
        bad += missed + len(pristine_fails)
        print(f"{lib.key:<22}{len(sample):>8}{ran:>5}{by_pytest:>18}{by_judge:>17}{missed:>14}{extra:>13}"
              f"{len(pristine_fails):>16}{time.monotonic() - t0:>6.0f}", flush=True)
    return 1 if bad else 0


def blind_stats() -> int:
    """What blinding removes from each library's test copy (static counts, no run)."""
    import ast

    from envs.swe import blind as Bl
    from envs.swe import observe as O

    def constants(trees) -> int:
        """Test data in the modules: str / number constants, the observation calls' own marks left out."""
        marks = {id(a) for t in trees for n in ast.walk(t) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == O.OBSERVE_NAME for a in n.args[:3]}
        return sum(isinstance(n, ast.Constant) and isinstance(n.value, (str, int, float, complex, bytes))
                   and not isinstance(n.value, bool) and id(n) not in marks for t in trees for n in ast.walk(t))

    print(f"{'library':<22}{'modules':>8}{'observations':>13}{'literal ops':>12}{'blinded ops':>12}"
          f"{'bindings':>9}{'columns':>8}{'helper args':>12}{'constants orig / literal-only / blinded':>41}")
    for name in L.LIBRARIES:
        lib = L.get_library(name)
        files = L.grading_files(lib, L.source_files(lib))
        srcs = {p: files[p].decode("utf-8", "replace") for p in L.test_files(lib, files) if p.endswith(".py")}
        orig = [ast.parse(s) for s in srcs.values()]
        trees = {p: t for p, s in srcs.items() if (t := O._observed(s)) is not None}
        calls = [n for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == O.OBSERVE_NAME]
        literal = sum(c.args[2].value.count("s") for c in calls)
        lit_consts = constants(trees.values())
        st = Bl.blind(trees)
        print(f"{lib.key:<22}{len(srcs):>8}{len(calls):>13}{literal:>12}{st.operands_dropped:>12}"
              f"{st.bindings_removed:>9}{st.columns_cleared:>8}{st.parameters_cleared:>12}"
              f"{constants(orig):>21} / {lit_consts} / {constants(trees.values())}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default="HEAD", help="revision whose runner is the 'before' (one-process) path")
    ap.add_argument("--edit-sweep", nargs="*", default=None, metavar="LIBRARY", choices=sorted(L.LIBRARIES),
                    help="only: validate the undoing of every mutation (of the libraries named; all if none)")
    ap.add_argument("--judge-sweep", nargs="*", default=None, metavar="LIBRARY", choices=sorted(L.LIBRARIES),
                    help="only: the value judge against pytest on --per-library sampled mutations of each library")
    ap.add_argument("--per-library", type=int, default=25)
    ap.add_argument("--blind-stats", action="store_true", help="only: what blinding removes from the test copies")
    a = ap.parse_args()
    if a.blind_stats:
        return blind_stats()
    if a.edit_sweep is not None:
        return edit_sweep(a.edit_sweep)
    if a.judge_sweep is not None:
        return judge_sweep(a.judge_sweep, a.per_library)
    from envs.sandbox.bwrap import BwrapBackend

    before = load_before(a.before)
    old_rt = before_runtime(before)
    backend = BwrapBackend()
    runtime, python = L.ensure_runtime(), L.interpreter()
    med = statistics.median
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(f"{'library':<22}{'tests':>6}{'local cpu s':>13}{'local wall s':>14}{'sandbox wall s':>16}"
          f"{'sandbox/local':>15}{'same as before':>16}")
    for name in L.LIBRARIES:
        lib = L.get_library(name)
        files = L.grading_files(lib, L.source_files(lib))
        cpu, wall, box = [], [], []
        n, same = 0, True
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as td:
                for rel, data in files.items():
                    (Path(td) / rel).parent.mkdir(parents=True, exist_ok=True)
                    (Path(td) / rel).write_bytes(data)
                r = run_suite_local(lib, Path(td), runtime, python)
                rb = before.run_suite_local(lib, Path(td), old_rt, python)
            same = same and r.ok and rb.ok and dict(r.outcomes) == dict(rb.outcomes)
            cpu.append(r.cpu_s)
            wall.append(r.duration_s)
            n = len(r.passed())
            t0 = time.monotonic()
            rs = G.run_in_sandbox(backend, lib, files)
            box.append(time.monotonic() - t0)
            assert rs.ok and rs.passed() == r.passed(), f"{name}: sandbox and local outcomes differ"
        print(f"{lib.key:<22}{n:>6}{med(cpu):>13.2f}{med(wall):>14.2f}{med(box):>16.2f}{med(box) / med(wall):>15.2f}"
              f"{'yes' if same else 'NO':>16}")

    small = B.ensure_built(B.SMALL, log=lambda *x: None)
    from envs.swe import observe as O

    for name in sorted({inst.library for inst in small}):  # once per library, then cached on disk
        lib = L.get_library(name)
        path = O._cache_path(lib)
        built = not path.exists()
        t0, c0 = time.monotonic(), cpu_now()
        O.reference(backend, lib)
        print(f"value-judge reference of {lib.key}: {'built' if built else 'cached'} in "
              f"{time.monotonic() - t0:.1f} s wall, {cpu_now() - c0:.1f} s CPU ({O.REFERENCE_RUNS} sandboxed runs)")
    print(f"\ngrading per small-set instance (reference fix), before = {a.before}'s runner, median of {a.repeats}:")
    print(f"{'instance':<58}{'before s':>10}{'after s':>10}{'after/before':>14}{'cpu bef':>10}{'cpu aft':>10}"
          f"{'cpu a/b':>10}")
    ratios, cpu_ratios = [], []
    for inst in small:
        task = task_of(inst)
        lib = I.task_library(task)
        lib_files = {p: b for p, b in I.agent_repo(task).items() if lib.is_library_path(p)}
        lib_files[inst.mutation.path] = I.pristine(lib.name)[inst.mutation.path]
        tree = I.grading_tree(task, lib_files)
        start = I.agent_repo(task)
        tb, tn, cb, cn = [], [], [], []
        for _ in range(a.repeats):
            t0, c0 = time.monotonic(), cpu_now()
            assert grade_before(backend, before, old_rt, lib, tree, inst.fail_to_pass, inst.pass_to_pass, start,
                                lib_files), inst.instance_id
            tb.append(time.monotonic() - t0)
            cb.append(cpu_now() - c0)
            t0, c0 = time.monotonic(), cpu_now()
            assert grade_now(backend, lib, task, start, lib_files), inst.instance_id
            tn.append(time.monotonic() - t0)
            cn.append(cpu_now() - c0)
        ratios.append(med(tn) / med(tb))
        cpu_ratios.append(med(cn) / med(cb))
        print(f"{inst.instance_id[:57]:<58}{med(tb):>10.2f}{med(tn):>10.2f}{ratios[-1]:>14.2f}"
              f"{med(cb):>10.2f}{med(cn):>10.2f}{cpu_ratios[-1]:>10.2f}")
    print(f"after/before wall: median {med(ratios):.2f}x, max {max(ratios):.2f}x; "
          f"CPU: median {med(cpu_ratios):.2f}x, max {max(cpu_ratios):.2f}x (budget 1.5x)")

    import envs
    from envs.play import ScriptedPolicy, run_episode
    from envs.swe.tasks import make_tasks

    task = make_tasks("train", 0, 1)[0]
    resets, episodes = [], []
    for _ in range(a.repeats):
        env = envs.make("swe-v0", backend=backend)
        t0 = time.monotonic()
        asyncio.run(env.reset(task))
        resets.append(time.monotonic() - t0)
        env.close()
        env = envs.make("swe-v0", backend=backend)
        t0 = time.monotonic()
        tr = asyncio.run(run_episode(env, task, ScriptedPolicy(env.reference(task))))
        episodes.append(time.monotonic() - t0)
        env.close()
        assert tr.grade.reward == 1.0, tr.grade
    print(f"\nepisode on {task.id}:")
    print(f"  reset (sandbox + repo + git commit): {med(resets):.2f} s")
    print(f"  reference episode incl. grading:     {med(episodes):.2f} s ({med(episodes) / med(resets):.1f}x reset)")
    print(f"load average: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
