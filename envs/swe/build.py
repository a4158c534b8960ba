"""Building swe-v0 instances: inject a bug, keep it only if the tests say it is a good task.

For each library (libraries.py): run the pristine suite twice (the baseline: tests that pass in
both runs), enumerate every mutation of its library files (mutate.py), order them so functions
take turns, and validate candidates in 2 worker processes. A candidate is kept only if

  * the suite still collects (no import or collection error),
  * at least one baseline test fails (FAIL_TO_PASS) and at most `MAX_F2P` do,
  * every other baseline test passes (PASS_TO_PASS) -- true by definition once F2P is the set of
    failing baseline tests; tests that fail or skip in the baseline are in neither set,
  * a second run gives exactly the same outcome for every baseline test (deterministic),
  * the suite took under `MAX_SUITE_S` seconds of CPU time (wall time on a shared machine is noise),
  * every FAIL_TO_PASS test function can be located and removed from the visible test files.

The train / held-out split is by library function: a function (`lib:path:qualname`) is held out
when the hash of its name falls in the first `HELDOUT_FRACTION`, so a held-out function never
has a train instance. The issue text is written from the failing tests' names, their exception
messages and their last traceback frames only (`issue_text`), never from the mutation.

The result is a `datasets.Dataset` under `<cache>/swe/instances/<name>-<BUILD_VERSION>-<key>/`
with a `build_report.json` next to it (counts of rejections per reason, timings). Bump
`BUILD_VERSION` when a change here should invalidate built sets (they are not keyed by source
hash: a full build takes tens of minutes).
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from envs.swe import libraries as L
from envs.swe.mutate import Mutation, enumerate_mutations
from envs.swe.runner import Failure, SuiteResult, run_suite_local

BUILD_VERSION = "b1"
HELDOUT_FRACTION = 0.2
MAX_F2P = 20  # more failing tests than this: the bug breaks a whole module's behaviour, not one feature
MAX_SUITE_S = 10.0
MAX_PER_FUNCTION = 2  # instances per library function, for variety
SUITE_TIMEOUT_S = 60.0
REJECT_REASONS = ("crash_or_timeout", "collection_error", "no_failure", "too_many_failures", "too_slow",
                  "nondeterministic", "unhideable")


@dataclass(frozen=True)
class BuildSpec:
    """Which instance set to build: libraries, how many per split, and the ordering seed."""

    name: str
    libraries: tuple[str, ...]
    n_train: int
    n_heldout: int
    seed: int = 0
    workers: int = 2

    def key(self) -> str:
        blob = json.dumps([BUILD_VERSION, [L.get_library(n).key for n in self.libraries], self.n_train,
                           self.n_heldout, self.seed, HELDOUT_FRACTION, MAX_F2P, MAX_PER_FUNCTION])
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def path(self) -> Path:
        return L.cache_root() / "instances" / f"{self.name}-{BUILD_VERSION}-{self.key()}"


SMALL = BuildSpec("small", ("toolz", "cachetools"), n_train=9, n_heldout=3)
FULL = BuildSpec("full", ("toolz", "cachetools", "tabulate", "more-itertools"), n_train=170, n_heldout=40)


@dataclass(frozen=True)
class HiddenSpan:
    """Lines [start, end] (1-based, inclusive) of a test file removed from the agent's copy;
    `placeholder` is written in their place (a `pass` when a class body would become empty)."""

    path: str
    start: int
    end: int
    placeholder: str = ""


@dataclass(frozen=True)
class Instance:
    instance_id: str
    library: str
    version: str
    split: str
    function: str  # "<library>:<path>:<qualname>": the split unit
    mutation: Mutation
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    hidden: tuple[HiddenSpan, ...]
    issue: str
    suite_s: float  # CPU seconds of the slower validation run

    def to_row(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "library": self.library, "version": self.version,
                "split": self.split, "function": self.function, "kind": self.mutation.kind,
                "mutation": json.dumps(dataclasses.asdict(self.mutation)),
                "fail_to_pass": json.dumps(list(self.fail_to_pass)),
                "pass_to_pass": json.dumps(list(self.pass_to_pass)),
                "hidden": json.dumps([dataclasses.asdict(h) for h in self.hidden]),
                "issue": self.issue, "suite_s": float(self.suite_s)}

    @staticmethod
    def from_row(row: Mapping[str, Any]) -> "Instance":
        return Instance(instance_id=row["instance_id"], library=row["library"], version=row["version"],
                        split=row["split"], function=row["function"], mutation=Mutation(**json.loads(row["mutation"])),
                        fail_to_pass=tuple(json.loads(row["fail_to_pass"])),
                        pass_to_pass=tuple(json.loads(row["pass_to_pass"])),
                        hidden=tuple(HiddenSpan(**h) for h in json.loads(row["hidden"])),
                        issue=row["issue"], suite_s=float(row["suite_s"]))


def function_key(lib: L.Library, m: Mutation) -> str:
    return f"{lib.name}:{m.path}:{m.function}"


def split_of(function: str) -> str:
    h = int(hashlib.sha256(f"swe-v0:{function}".encode()).hexdigest()[:8], 16) / 16 ** 8
    return "heldout" if h < HELDOUT_FRACTION else "train"


# ----------------------------------------------------------------------------- hiding tests
def hide_spans(test_sources: Mapping[str, str], f2p: Sequence[str],
               locations: Mapping[str, tuple[str, int]]) -> tuple[HiddenSpan, ...] | None:
    """The line spans to remove so that no FAIL_TO_PASS test function is visible; None if some
    test cannot be located as a module-level function or a method of a module-level class."""
    wanted: dict[str, set[int]] = {}
    for nid in f2p:
        loc = locations.get(nid)
        if loc is None or loc[0] not in test_sources:
            return None
        wanted.setdefault(loc[0], set()).add(loc[1])
    spans: list[HiddenSpan] = []
    for path, firsts in sorted(wanted.items()):
        tree = ast.parse(test_sources[path])
        found: dict[int, ast.AST] = {}
        classes: list[ast.ClassDef] = []
        for node in tree.body:
            members = [node]
            if isinstance(node, ast.ClassDef):
                classes.append(node)
                members = node.body
            for sub in members:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([sub.lineno] + [d.lineno for d in sub.decorator_list])
                    found[first] = sub
        if not firsts <= set(found):
            return None
        removed = {id(found[f]) for f in firsts}
        for first in sorted(firsts):
            node = found[first]
            placeholder = ""
            for cls in classes:
                if node in cls.body and all(id(s) in removed for s in cls.body) and cls.body[0] is node:
                    placeholder = " " * node.col_offset + "pass"
            spans.append(HiddenSpan(path, first, node.end_lineno, placeholder))
    return tuple(spans)


def apply_hidden(source: str, spans: Iterable[HiddenSpan]) -> str:
    lines = source.splitlines(keepends=True)
    for sp in sorted(spans, key=lambda s: -s.start):
        repl = [sp.placeholder + "\n"] if sp.placeholder else []
        lines[sp.start - 1: sp.end] = repl
    return "".join(lines)


# ----------------------------------------------------------------------------- issue text
_OPENINGS = (
    "I ran the {lib} test-suite against the current checkout and some tests fail.",
    "Something is broken in {lib}: the following test(s) no longer pass.",
    "After the latest changes, {lib} behaves incorrectly; here is what the tests report.",
)


def issue_text(lib: L.Library, f2p: Sequence[str], failures: Mapping[str, Failure], rng: random.Random) -> str:
    """An issue written from test names, exception messages and last traceback frames only."""
    names = [nid.split("::")[-1].split("[")[0] for nid in f2p]
    title = f"{names[0]} fails" + (f" (and {len(f2p) - 1} more test{'s' * (len(f2p) > 2)})" if len(f2p) > 1 else "")
    lines = [f"# {lib.name}: {title}", "", rng.choice(_OPENINGS).format(lib=lib.name), ""]
    for nid in f2p[:3]:
        f = failures.get(nid)
        lines.append(f"## `{nid}`")
        if f is not None:
            msg = "\n".join(f.message.strip().splitlines()[:12])[:1200]
            lines += ["", "```", msg, "```"]
            frames = [fr for fr in f.frames if not fr[0].startswith("<outside>")]  # pytest's own frames
            if frames:
                lines += ["", "Last frames of the traceback:", "```"]
                lines += [f'  File "{p}", line {n}, in {fn}' for p, n, fn in frames[-3:]]
                lines.append("```")
        lines.append("")
    if len(f2p) > 3:
        lines += ["Also failing: " + ", ".join(f"`{n}`" for n in f2p[3:12]) + (" ..." if len(f2p) > 12 else ""), ""]
    lines.append("The tests describe the intended behaviour; please fix the library code (not the tests).")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class Candidate:
    library: str
    mutation: Mutation
    split: str


@dataclass(frozen=True)
class Verdict:
    reason: str  # "ok" or one of REJECT_REASONS
    fail_to_pass: tuple[str, ...] = ()
    failures: Mapping[str, Failure] = dataclasses.field(default_factory=dict)
    locations: Mapping[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    suite_s: float = 0.0


@dataclass(frozen=True)
class Baseline:
    passed: tuple[str, ...]
    outcomes: Mapping[str, str]
    suite_s: float


_W: dict[str, Any] = {}  # per worker process: scratch trees, baselines


def _worker_init(libs: Sequence[str], baselines: Mapping[str, Baseline], runtime: str, python: str,
                 scratch_parent: str) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="worker-", dir=scratch_parent))
    trees = {}
    for name in libs:
        lib = L.get_library(name)
        dst = scratch / lib.key
        files = L.grading_files(lib, L.source_files(lib))
        for rel, data in files.items():
            p = dst / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        trees[name] = dst
    _W.update(scratch=scratch, trees=trees, baselines=baselines, runtime=Path(runtime), python=Path(python))


def validate(c: Candidate) -> Verdict:
    """Run the suite on the mutated tree (twice if the first run qualifies); see the module docstring."""
    lib = L.get_library(c.library)
    tree: Path = _W["trees"][c.library]
    base: Baseline = _W["baselines"][c.library]
    target = tree / c.mutation.path
    original = target.read_text(encoding="utf-8")
    try:
        target.write_text(c.mutation.apply(original), encoding="utf-8")
        r1 = run_suite_local(lib, tree, _W["runtime"], _W["python"], timeout_s=SUITE_TIMEOUT_S)
        if not r1.ok:
            return Verdict("crash_or_timeout")
        if r1.collect_errors:
            return Verdict("collection_error")
        f2p = tuple(sorted(r1.not_passed(base.passed)))
        if not f2p:
            return Verdict("no_failure")
        if len(f2p) > MAX_F2P:
            return Verdict("too_many_failures")
        if r1.cpu_s > MAX_SUITE_S:
            return Verdict("too_slow")
        r2 = run_suite_local(lib, tree, _W["runtime"], _W["python"], timeout_s=SUITE_TIMEOUT_S)
        if not r2.ok or any(r1.outcomes.get(t) != r2.outcomes.get(t) for t in base.passed):
            return Verdict("nondeterministic")
        return Verdict("ok", f2p, {k: r1.failures[k] for k in f2p if k in r1.failures},
                       {k: r1.locations[k] for k in f2p if k in r1.locations}, max(r1.cpu_s, r2.cpu_s))
    finally:
        target.write_text(original, encoding="utf-8")


def baseline(lib: L.Library, runtime: Path, python: Path) -> Baseline:
    """Two runs of the pristine suite; the tests that pass in both (with equal outcomes elsewhere)."""
    with tempfile.TemporaryDirectory(prefix="swe-base-") as td:
        tree = Path(td)
        for rel, data in L.grading_files(lib, L.source_files(lib)).items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(data)
        runs = [run_suite_local(lib, tree, runtime, python, timeout_s=3 * SUITE_TIMEOUT_S) for _ in range(2)]
    for r in runs:
        if not r.ok or r.collect_errors:
            raise RuntimeError(f"{lib.key}: the pristine suite did not run cleanly: {r.collect_errors} {r.output_tail}")
    passed = tuple(sorted(runs[0].passed() & runs[1].passed()))
    if not passed:
        raise RuntimeError(f"{lib.key}: no test passes on the pristine source")
    return Baseline(passed=passed, outcomes=dict(runs[0].outcomes), suite_s=max(r.cpu_s for r in runs))


def candidates(lib: L.Library, seed: int) -> list[Candidate]:
    """Every mutation of the library, ordered so that functions take turns (round robin over a
    seeded shuffle of functions, each function's mutations shuffled too)."""
    files = L.source_files(lib)
    by_fn: dict[str, list[Mutation]] = {}
    for path in L.mutable_files(lib, files):
        for m in enumerate_mutations(path, files[path].decode("utf-8")):
            by_fn.setdefault(function_key(lib, m), []).append(m)
    rng = random.Random(f"swe-v0:candidates:{lib.key}:{seed}")
    fns = sorted(by_fn)
    rng.shuffle(fns)
    for f in fns:
        rng.shuffle(by_fn[f])
    out = []
    for rnd in range(max((len(v) for v in by_fn.values()), default=0)):
        for f in fns:
            if rnd < len(by_fn[f]):
                out.append(Candidate(lib.name, by_fn[f][rnd], split_of(f)))
    return out


def _interleave(lists: Sequence[Sequence[Candidate]]) -> list[Candidate]:
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def make_instance(c: Candidate, v: Verdict, lib: L.Library, base: Baseline, files: Mapping[str, bytes]) -> Instance | None:
    tests = {p: files[p].decode("utf-8") for p in L.test_files(lib, files) if p.endswith(".py")}
    spans = hide_spans(tests, v.fail_to_pass, v.locations)
    if spans is None:
        return None
    for path in {s.path for s in spans}:
        ast.parse(apply_hidden(tests[path], [s for s in spans if s.path == path]))  # still valid Python
    m = c.mutation
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(m), sort_keys=True).encode()).hexdigest()[:8]
    iid = f"{lib.name}__{m.function}__{m.kind}__{digest}"
    rng = random.Random(f"swe-v0:issue:{iid}")
    p2p = tuple(t for t in base.passed if t not in set(v.fail_to_pass))
    return Instance(instance_id=iid, library=lib.name, version=lib.version, split=c.split,
                    function=function_key(lib, m), mutation=m, fail_to_pass=v.fail_to_pass, pass_to_pass=p2p,
                    hidden=spans, issue=issue_text(lib, v.fail_to_pass, v.failures, rng), suite_s=v.suite_s)


def build(spec: BuildSpec, *, progress: bool = False, log=print) -> tuple[list[Instance], dict[str, Any]]:
    """Validate candidates until every (library, split) quota is met or candidates run out."""
    t0 = time.monotonic()
    runtime = L.ensure_runtime()
    python = L.interpreter()
    libs = [L.get_library(n) for n in spec.libraries]
    for lib in libs:
        L.ensure_source(lib)
    bases = {lib.name: baseline(lib, runtime, python) for lib in libs}
    for lib in libs:
        log(f"{lib.key}: baseline {len(bases[lib.name].passed)} passing tests, {bases[lib.name].suite_s:.1f} s")
    quota = {"train": spec.n_train, "heldout": spec.n_heldout}
    per_lib = {(lib.name, s): math.ceil(q / len(libs)) for lib in libs for s, q in quota.items()}
    queue = _interleave([candidates(lib, spec.seed) for lib in libs])
    accepted: list[Instance] = []
    per_fn: Counter = Counter()
    got: Counter = Counter()
    got_lib: Counter = Counter()
    reasons: Counter = Counter()
    evaluated = 0
    files = {lib.name: L.source_files(lib) for lib in libs}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=spec.n_train + spec.n_heldout, desc=f"swe {spec.name}", unit="inst")
    # Verdicts are appended to a checkpoint as they come, so an interrupted build resumes
    # (validation is the slow part); candidates are keyed by library version and mutation.
    ckpt = spec.path().parent / f"{spec.path().name}.progress.jsonl"
    done = _load_checkpoint(ckpt)
    if done:
        log(f"resuming: {len(done)} verdicts from {ckpt}")
    ctx = mp.get_context("fork")
    scratch_parent = tempfile.mkdtemp(prefix="swe-build-")
    pool = ctx.Pool(spec.workers, initializer=_worker_init,
                    initargs=(spec.libraries, bases, str(runtime), str(python), scratch_parent))
    try:
        chunk_size = 4 * spec.workers
        remaining = queue
        while remaining and any(got[s] < quota[s] for s in quota):
            # Fill a chunk in queue order. A candidate whose quota is already met by accepted
            # instances is dropped; one blocked only by candidates pending in this chunk waits.
            chunk: list[Candidate] = []
            keep: list[Candidate] = []
            pend: Counter = Counter()
            for c in remaining:
                fk = function_key(L.get_library(c.library), c.mutation)
                lk = (c.library, c.split)
                if got[c.split] >= quota[c.split] or got_lib[lk] >= per_lib[lk] or per_fn[fk] >= MAX_PER_FUNCTION:
                    continue
                if (len(chunk) >= chunk_size or got[c.split] + pend[c.split] >= quota[c.split]
                        or got_lib[lk] + pend[lk] >= per_lib[lk] or per_fn[fk] + pend[fk] >= MAX_PER_FUNCTION):
                    keep.append(c)
                    continue
                chunk.append(c)
                pend.update([c.split, lk, fk])
            remaining = keep
            if not chunk:
                break
            todo = [c for c in chunk if _ckey(c) not in done]
            fresh = dict(zip(map(_ckey, todo), pool.map(validate, todo, chunksize=1))) if todo else {}
            for k, v in fresh.items():
                _append_checkpoint(ckpt, k, v)
            for c in chunk:
                v = fresh.get(_ckey(c)) or done[_ckey(c)]
                evaluated += 1
                lib = L.get_library(c.library)
                fk = function_key(lib, c.mutation)
                inst = make_instance(c, v, lib, bases[c.library], files[c.library]) if v.reason == "ok" else None
                if v.reason == "ok" and inst is None:
                    v = dataclasses.replace(v, reason="unhideable")
                reasons[v.reason] += 1
                if inst is None:
                    continue
                accepted.append(inst)
                got[c.split] += 1
                got_lib[(c.library, c.split)] += 1
                per_fn[fk] += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(evaluated=evaluated, rejected=evaluated - len(accepted))
    finally:
        pool.close()
        pool.join()
        shutil.rmtree(scratch_parent, ignore_errors=True)
        if bar is not None:
            bar.close()
    report = {"spec": dataclasses.asdict(spec), "build_version": BUILD_VERSION, "elapsed_s": round(time.monotonic() - t0, 1),
              "evaluated": evaluated, "accepted": len(accepted), "reasons": dict(reasons),
              "per_split": dict(got), "per_library": {f"{k[0]}/{k[1]}": v for k, v in sorted(got_lib.items())},
              "libraries": {lib.name: {"version": lib.version, "licence": lib.licence, "sha256": lib.sha256,
                                       "baseline_tests": len(bases[lib.name].passed),
                                       "baseline_s": round(bases[lib.name].suite_s, 2)} for lib in libs}}
    return accepted, report


def _ckey(c: Candidate) -> str:
    return hashlib.sha256(json.dumps([L.get_library(c.library).key, dataclasses.asdict(c.mutation)],
                                     sort_keys=True).encode()).hexdigest()[:20]


def _append_checkpoint(path: Path, key: str, v: Verdict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"key": key, "reason": v.reason, "fail_to_pass": list(v.fail_to_pass), "suite_s": v.suite_s,
           "failures": {k: dataclasses.asdict(f) for k, f in v.failures.items()},
           "locations": {k: list(loc) for k, loc in v.locations.items()}}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _load_checkpoint(path: Path) -> dict[str, Verdict]:
    out: dict[str, Verdict] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line cut by an interrupted write
            continue
        out[r["key"]] = Verdict(r["reason"], tuple(r["fail_to_pass"]),
                                {k: Failure(message=f["message"], frames=tuple(tuple(x) for x in f["frames"]),
                                            when=f.get("when", "call")) for k, f in r["failures"].items()},
                                {k: (v[0], int(v[1])) for k, v in r["locations"].items()}, float(r["suite_s"]))
    return out


# ----------------------------------------------------------------------------- the cached dataset
def save(spec: BuildSpec, instances: Sequence[Instance], report: Mapping[str, Any]) -> Path:
    import datasets

    path = spec.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp", dir=path.parent))
    try:
        ds = datasets.Dataset.from_list([i.to_row() for i in instances])
        ds.save_to_disk(str(tmp / "data"))
        (tmp / "build_report.json").write_text(json.dumps(report, indent=1))
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sets_marker().write_text(f"{path.name} {time.time():.0f}\n")
    return path


def sets_marker() -> Path:
    """A file rewritten whenever an instance set is saved. It is one of the registry's source
    files for swe-v0, so `envs.tasks("swe-v0", ...)` caches are invalidated by a new build."""
    p = L.cache_root() / "instances" / "LAST_SAVED"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    return p


def load(spec: BuildSpec) -> list[Instance] | None:
    path = spec.path() / "data"
    if not (path / "dataset_info.json").exists():
        return None
    import datasets

    return [Instance.from_row(r) for r in datasets.load_from_disk(str(path))]


def ensure_built(spec: BuildSpec, *, progress: bool = False, log=print) -> list[Instance]:
    got = load(spec)
    if got is None:
        instances, report = build(spec, progress=progress, log=log)
        save(spec, instances, report)
        got = load(spec)
        assert got is not None
    return got
