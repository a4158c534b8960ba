"""The instance set of swe-onefunc-v0: one-line bugs in short functions, each with a failing test to show.

Candidates are swe-v0's own (`build.candidates`: every mutation of every library function, functions
taking turns in a seeded order), narrowed before anything runs to bugs a small model can fix by
reading one short function:

  * kinds whose fix is a local, one-token or one-line revert readable from the code around it:
    every kind of mutate.py except `remove_condition` that drops a whole operand of `and` / `or`
    (the dropped text is nowhere to be read back); dropping a `not` stays;
  * the enclosing function is at most `MAX_FUNCTION_LINES` long (the reference views all of it);
  * the buggy line, stripped of its indentation, occurs exactly once in the buggy file, so the
    reference edit is that one line (`old`) and its fixed text (`new`).

Each candidate is then validated exactly as in swe-v0 (`build.validate` in 2 worker processes:
the suite collects, 1-20 baseline tests fail, all others pass, the same outcome twice, under 10 s
of CPU), and its FAIL_TO_PASS tests are hidden from the agent's copy (`build.make_instance`). The
rung adds two conditions: at least `MIN_F2P` tests fail, because one of them is shown in the
prompt and a patch that only satisfies the shown one must still fail a hidden one; and the shown
test (the shortest failing test function) has at most `MAX_TEST_LINES` lines.

Split by library function (`lib:path:qualname`, as in swe-v0): a function is held out if swe-v0
holds it out (so the rung's train set never contains a function swe-v0 evaluates on) or if
envs/splits.py's hash ranking puts it among the first `EXTRA_HELDOUT` of swe-v0's train functions
of its library. Held-out functions never have a train instance.

The set is saved under `<cache>/swe/instances/onefunc-<BUILD_VERSION>-<key>/` (a `datasets.Dataset`
plus `build_report.json`); verdicts are appended to `onefunc-<BUILD_VERSION>.progress.jsonl` next to
it as they come, so an interrupted build resumes, and verdicts already in swe-v0's own checkpoints
are reused (a verdict depends only on the library version and the mutation).

This module does not grade, run episodes or write prompts (onefunc.py does the last).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing as mp
import re
import shutil
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from envs.splits import split_by_hash
from envs.swe import build as B
from envs.swe import libraries as L
from envs.swe.mutate import Mutation, _functions, enumerate_mutations
from jointrl import paths

log = logging.getLogger(__name__)

ONEFUNC_VERSION = "o2"  # bump when a change here should invalidate built rung sets
LIBRARIES = B.FULL.libraries
N_TRAIN = 220  # the full set's quotas: enough held-out tasks to resolve ~10 points of success
N_HELDOUT = 150
MAX_PER_FUNCTION = 3  # instances per library function (different bugs of one function add variety)
MAX_FUNCTION_LINES = 30  # the reference views the whole function: its lines are episode tokens
MIN_F2P = 2  # failing tests per instance: one is shown, at least one stays hidden
MAX_TEST_LINES = 20  # the shown test's size (prompt tokens)
MAX_TEST_CHARS = 1000
MAX_FAILURE_LINES = 10  # the shown assertion output, clipped
MAX_FAILURE_CHARS = 600
EXTRA_HELDOUT = 0.2  # share of swe-v0's train functions the rung also holds out
WORKERS = 2  # validation processes


@dataclass(frozen=True)
class OneFuncInstance:
    """A swe-v0 instance plus what the rung shows and the reference edit.

    base: the validated swe-v0 instance (mutation, FAIL_TO_PASS / PASS_TO_PASS, hidden spans);
        grading uses nothing else. `base.split` is the rung's split.
    shown_test: node id of the failing test shown in the prompt (one of `base.fail_to_pass`).
    test_source: that test function's source, dedented.
    failure: its assertion output (pytest's explanation), clipped to a few lines.
    crash_frame: "path:line in function" when the traceback ends inside library code, else "".
    first_line, last_line: the buggy function's lines (decorators included) in the buggy file.
    old, new: the reference `str_replace`: the buggy line stripped of indentation, and its fix.
    """

    base: B.Instance
    shown_test: str
    test_source: str
    failure: str
    crash_frame: str
    first_line: int
    last_line: int
    old: str
    new: str

    def to_row(self) -> dict[str, Any]:
        extra = {k: getattr(self, k) for k in ("shown_test", "test_source", "failure", "crash_frame",
                                                "first_line", "last_line", "old", "new")}
        return {**self.base.to_row(), "onefunc": json.dumps(extra)}

    @staticmethod
    def from_row(row: Mapping[str, Any]) -> "OneFuncInstance":
        return OneFuncInstance(base=B.Instance.from_row(row), **json.loads(row["onefunc"]))


@dataclass(frozen=True)
class Spec:
    """Which rung set to build; its key names the cache directory."""

    name: str
    libraries: tuple[str, ...]
    n_train: int
    n_heldout: int
    seed: int = 0
    workers: int = WORKERS

    def key(self) -> str:
        blob = json.dumps([ONEFUNC_VERSION, B.BUILD_VERSION, [L.get_library(n).key for n in self.libraries],
                           self.n_train, self.n_heldout, self.seed, MAX_PER_FUNCTION, MAX_FUNCTION_LINES, MIN_F2P,
                           MAX_TEST_LINES, MAX_TEST_CHARS, MAX_FAILURE_LINES, MAX_FAILURE_CHARS, EXTRA_HELDOUT,
                           B.HELDOUT_FRACTION])
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def path(self) -> Path:
        return L.cache_root() / "instances" / f"onefunc-{self.name}-{B.BUILD_VERSION}-{self.key()}"

    def checkpoint(self) -> Path:
        """Verdicts, shared by every rung spec: a verdict depends only on the library version and the
        mutation (its key), not on quotas or filters."""
        return self.path().parent / f"onefunc-{B.BUILD_VERSION}.progress.jsonl"


FULL = Spec("full", LIBRARIES, n_train=N_TRAIN, n_heldout=N_HELDOUT)
# What a machine without the full set builds at first use (minutes): the first candidates of two
# libraries in the same order as the full build, whose verdicts it shares.
SMALL = Spec("small", ("toolz", "cachetools"), n_train=8, n_heldout=6)


# ----------------------------------------------------------------------------- selection
def fixable(m: Mutation) -> bool:
    """The fix can be read from the code around the bug (see the module docstring)."""
    return not (m.kind == "remove_condition" and m.replacement != "")


def function_spans(source: str) -> dict[str, tuple[int, int]]:
    """qualname -> (first line with decorators, last line) for mutate.py's functions and methods."""
    return {q: (min([fn.lineno] + [d.lineno for d in fn.decorator_list]), fn.end_lineno)
            for q, fn in _functions(ast.parse(source))}


def reference_lines(m: Mutation, source: str) -> tuple[str, str] | None:
    """(old, new) for the one-line reference fix, or None when the stripped buggy line is not unique."""
    buggy = m.apply(source)
    old = buggy.splitlines()[m.line - 1].strip()
    new = m.revert(buggy).splitlines()[m.line - 1].strip()
    if not old or old == new or buggy.count(old) != 1:
        return None
    return old, new


@functools.lru_cache(maxsize=None)
def library_functions(lib: L.Library) -> tuple[str, ...]:
    """Keys of every function of `lib` that has a mutation: the universe the split is drawn from."""
    files = L.source_files(lib)
    return tuple(sorted({B.function_key(lib, m) for path in L.mutable_files(lib, files)
                         for m in enumerate_mutations(path, files[path].decode("utf-8"))}))


def heldout_functions(lib: L.Library) -> frozenset[str]:
    """Function keys held out by the rung: swe-v0's held-out ones plus EXTRA_HELDOUT of the rest."""
    fns = library_functions(lib)
    v0_held = {f for f in fns if B.split_of(f) == "heldout"}
    extra = split_by_hash(f"swe-onefunc:{lib.name}", [(f,) for f in fns if f not in v0_held], EXTRA_HELDOUT)
    return frozenset(v0_held | {v[0] for v in extra["heldout"]})


def candidates(lib: L.Library, seed: int) -> list[B.Candidate]:
    """swe-v0's candidate order for `lib`, narrowed to the rung's bugs and relabelled with its split."""
    files = L.source_files(lib)
    held = heldout_functions(lib)
    spans: dict[str, dict[str, tuple[int, int]]] = {}
    out = []
    for c in B.candidates(lib, seed):
        m = c.mutation
        source = files[m.path].decode("utf-8")
        if m.path not in spans:
            spans[m.path] = function_spans(source)
        first, last = spans[m.path][m.function]
        if not fixable(m) or last - first + 1 > MAX_FUNCTION_LINES or reference_lines(m, source) is None:
            continue
        split = "heldout" if B.function_key(lib, m) in held else "train"
        out.append(dataclasses.replace(c, split=split))
    return out


# ----------------------------------------------------------------------------- instances
def _clip_failure(message: str) -> str:
    """The first lines of a failure message, object addresses blanked (noise a model cannot use)."""
    lines = re.sub(r"\b0x[0-9a-f]{6,}\b", "0x...", message.strip()).splitlines()
    text = "\n".join(lines[:MAX_FAILURE_LINES])
    if len(text) > MAX_FAILURE_CHARS:
        text = text[:MAX_FAILURE_CHARS].rstrip() + " ..."
    elif len(lines) > MAX_FAILURE_LINES:
        text += "\n..."
    return text


def make_onefunc(c: B.Candidate, v: B.Verdict, lib: L.Library, base: B.Baseline,
                 files: Mapping[str, bytes]) -> tuple[OneFuncInstance | None, str]:
    """(instance, "ok") or (None, reject reason) for a validated candidate."""
    if v.reason != "ok":
        return None, v.reason
    if len(v.fail_to_pass) < MIN_F2P:
        return None, "too_few_failures"
    inst = B.make_instance(c, v, lib, base, files)
    if inst is None:
        return None, "unhideable"
    shown = []
    for nid in v.fail_to_pass:
        loc, fail = v.locations.get(nid), v.failures.get(nid)
        if loc is None or fail is None or not fail.message.strip():
            continue
        span = next((s for s in inst.hidden if s.path == loc[0] and s.start <= loc[1] <= s.end), None)
        if span is None:
            continue
        lines = files[span.path].decode("utf-8").splitlines()[span.start - 1: span.end]
        src = textwrap.dedent("\n".join(lines)).strip("\n")
        if len(lines) <= MAX_TEST_LINES and len(src) <= MAX_TEST_CHARS:
            shown.append((len(src), nid, src, fail))
    if not shown:
        return None, "test_too_long"
    _, nid, src, fail = min(shown, key=lambda x: (x[0], x[1]))
    m = c.mutation
    source = files[m.path].decode("utf-8")
    first, last = function_spans(m.apply(source))[m.function]
    ref = reference_lines(m, source)
    assert ref is not None  # candidates() kept only mutations with a unique line
    end = fail.frames[-1] if fail.frames else None
    crash = f"{end[0]}:{end[1]} in {end[2]}" if end is not None and lib.is_library_path(end[0]) else ""
    return OneFuncInstance(base=inst, shown_test=nid, test_source=src, failure=_clip_failure(fail.message),
                           crash_frame=crash, first_line=first, last_line=last, old=ref[0], new=ref[1]), "ok"


# ----------------------------------------------------------------------------- the build
def _known_verdicts(spec: Spec) -> dict[str, B.Verdict]:
    """Verdicts already computed: swe-v0's checkpoints first, then this set's own."""
    out: dict[str, B.Verdict] = {}
    for s in (B.SMALL, B.FULL):
        out.update(B._load_checkpoint(s.path().parent / f"{s.path().name}.progress.jsonl"))
    out.update(B._load_checkpoint(spec.checkpoint()))
    return out


def build(spec: Spec, *, log_fn: Callable[[str], None] = log.info) -> tuple[list[OneFuncInstance], dict[str, Any]]:
    """Validate candidates (libraries taking turns) until both split quotas are met or candidates run out."""
    t0 = time.monotonic()
    runtime, python = L.ensure_runtime(), L.interpreter()
    libs = [L.get_library(n) for n in spec.libraries]
    for lib in libs:
        L.ensure_source(lib)
    bases = {lib.name: B.baseline(lib, runtime, python) for lib in libs}
    files = {lib.name: L.source_files(lib) for lib in libs}
    queue = B._interleave([candidates(lib, spec.seed) for lib in libs])
    log_fn(f"swe-onefunc: {len(queue)} candidates over {len(libs)} libraries")
    quota = {"train": spec.n_train, "heldout": spec.n_heldout}
    done = _known_verdicts(spec)
    accepted: list[OneFuncInstance] = []
    got: Counter = Counter()
    per_fn: Counter = Counter()
    reasons: Counter = Counter()
    evaluated = validated = 0
    scratch = tempfile.mkdtemp(prefix="swe-onefunc-build-")
    pool = mp.get_context("fork").Pool(spec.workers, initializer=B._worker_init,
                                       initargs=(spec.libraries, bases, str(runtime), str(python), scratch))
    try:
        pos = 0
        while pos < len(queue) and any(got[s] < quota[s] for s in quota):
            # The next chunk: candidates whose split and function still have room, counting the
            # chunk's own pending ones (a chunk never overfills a quota).
            chunk: list[B.Candidate] = []
            pend: Counter = Counter()
            while pos < len(queue) and len(chunk) < 4 * spec.workers:
                c = queue[pos]
                fk = B.function_key(L.get_library(c.library), c.mutation)
                if got[c.split] + pend[c.split] < quota[c.split] and per_fn[fk] + pend[fk] < MAX_PER_FUNCTION:
                    chunk.append(c)
                    pend.update([c.split, fk])
                elif got[c.split] >= quota[c.split] or per_fn[fk] >= MAX_PER_FUNCTION:
                    pass  # never needed
                else:
                    break  # may be needed if a pending candidate is rejected: retry it next chunk
                pos += 1
            if not chunk:
                break
            todo = [c for c in chunk if B._ckey(c) not in done]
            fresh = dict(zip(map(B._ckey, todo), pool.map(B.validate, todo, chunksize=1))) if todo else {}
            validated += len(todo)
            for k, v in fresh.items():
                B._append_checkpoint(spec.checkpoint(), k, v)
                done[k] = v
            for c in chunk:
                evaluated += 1
                lib = L.get_library(c.library)
                inst, reason = make_onefunc(c, done[B._ckey(c)], lib, bases[c.library], files[c.library])
                reasons[reason] += 1
                if inst is not None:
                    accepted.append(inst)
                    got[c.split] += 1
                    per_fn[B.function_key(lib, c.mutation)] += 1
            log_fn(f"swe-onefunc: {evaluated} evaluated ({validated} run), accepted train {got['train']}/{quota['train']}, "
                   f"heldout {got['heldout']}/{quota['heldout']}, {time.monotonic() - t0:.0f} s")
    finally:
        pool.close()
        pool.join()
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"spec": dataclasses.asdict(spec), "onefunc_version": ONEFUNC_VERSION, "build_version": B.BUILD_VERSION,
              "elapsed_s": round(time.monotonic() - t0, 1), "candidates": len(queue), "evaluated": evaluated,
              "validated_here": validated, "accepted": len(accepted), "reasons": dict(reasons), "per_split": dict(got),
              "per_library": dict(Counter(f"{i.base.library}/{i.base.split}" for i in accepted)),
              "kinds": dict(Counter(i.base.mutation.kind for i in accepted))}
    return accepted, report


def save(spec: Spec, instances: list[OneFuncInstance], report: Mapping[str, Any]) -> Path:
    import datasets

    path = spec.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp", dir=path.parent))
    try:
        datasets.Dataset.from_list([i.to_row() for i in instances]).save_to_disk(str(tmp / "data"))
        (tmp / "build_report.json").write_text(json.dumps(report, indent=1))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # The registry keys cached task sets on this file (envs/swe/__init__.py): a new set invalidates them.
    B.sets_marker().write_text(f"{path.name} {time.time():.0f}\n")
    return path


def load(spec: Spec) -> list[OneFuncInstance] | None:
    data = spec.path() / "data"
    if not (data / "dataset_info.json").exists():
        return None
    import datasets

    return [OneFuncInstance.from_row(r) for r in datasets.load_from_disk(str(data))]


_LOCK = threading.Lock()


def ensure_built(spec: Spec, *, log_fn: Callable[[str], None] = log.warning) -> list[OneFuncInstance]:
    """The built set, building it first if it is not cached (tens of minutes on 2 cores)."""
    # One builder per set across processes (rollout workers may all ask at once); the rest wait and load it.
    with _LOCK, paths.cache_lock(spec.path().parent / f"{spec.path().name}.lock"):
        got = load(spec)
        if got is None:
            log_fn(f"swe-onefunc: building the instance set into {spec.path()} (tens of minutes on 2 cores; "
                   f"progress in {spec.checkpoint()})")
            instances, report = build(spec, log_fn=log_fn)
            save(spec, instances, report)
            got = load(spec)
            assert got is not None
        return got


if __name__ == "__main__":  # python -m envs.swe.onefunc_build [small|full]: build (or find) a set, print its report
    import sys

    chosen = {"full": FULL, "small": SMALL}[sys.argv[1] if len(sys.argv) > 1 else "full"]
    ensure_built(chosen, log_fn=print)
    print((chosen.path() / "build_report.json").read_text())
