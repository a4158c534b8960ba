"""The verdict outside the tested process: tests report values, the host compares them with the
reference's.

The grading run's worker holds the agent's code, so anything it *says* (outcomes, exit status,
"passed") can be forged by code with full control of it. What it cannot forge without doing the
work is the values the correct library computes. So:

1. `transform_tests` rewrites every test file of the grading tree (host side, on source text)
   so that the tests *report* instead of *assert*: each `assert` statement and each unittest
   `self.assertX(...)` call becomes `_jointrl_observe(kind, how, mask, *operands)`, and every
   operand that is a literal (`[1, 2]`, `"a b"`, `-3`, `{1: 2}`) is dropped from the tested
   copy: the expected values the tests spell out never reach the tested process. Where no
   operand was dropped the worker also evaluates the comparison (or the unittest assertion) and
   reports its result. `pytest.raises` / `assertRaises` blocks are kept: they decide the flow.
2. The worker (runner.WORKER_SOURCE, `observe`) turns each operand into a canonical string of
   plain data (builtin scalars and containers by content, other objects by type name, a
   collection's items by iteration, never `repr` or `__eq__` of library objects), and streams one
   record per test (`k: "obs"`: the strings, and how the call ended) to the judge, which accepts
   at most one per test, only between that test's setup and teardown, only lists of bounded
   strings; anything else makes the run unbelievable (no pass).
3. `reference(backend, lib)`: the same transformed tests run on the *pristine* library (the
   release: what every reference fix restores, docs/swe.md) in their own fresh sandbox,
   `REFERENCE_RUNS` times; values that differ between the runs are masked. Cached per library on disk: the agent's
   code never runs there, and the expected values never leave the host.
4. `Reference.passed(nid, result)`: a test passes when its record is there and equals the
   reference's, string for string (masked positions skipped), and it ended the same way. The
   comparison is of `str`s the host parsed from JSON (never objects the tested process made), so
   an `__eq__` that says yes to everything has nothing to act on.

Then blind.py takes out of the tested copy what the tests compute only to compare with
(expected-only variables, table columns, reported-only helper parameters), across all test
modules of the library together (`transform_modules`).

What it does not claim: the tested process still holds the test code minus what was taken out, so
expected values that are also library inputs, decide the flow, or sit in constructs blinding does
not follow (`parametrize` tables, class attributes) are in its memory; code with full control
there could read them. Closing that needs the tests out of the tested process altogether
(docs/swe.md, "Not covered"). The static splice and allow-list (editcheck.py) are what keep agent
code from getting that control in the first place.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from envs.swe import blind
from envs.swe import libraries as L

log = logging.getLogger(__name__)

OBSERVE_NAME = "_jointrl_observe"
# unittest assertions that decide the flow (they must raise for the test to go on): left as they are.
FLOW_ASSERTIONS = frozenset({"assertRaises", "assertRaisesRegex", "assertRaisesRegexp", "assertWarns",
                             "assertWarnsRegex", "assertLogs", "assertNoLogs"})
_LITERAL_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.Load,
                  ast.operator, ast.unaryop)
_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is",
        ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
# Bumped when the transform or the record format changes: cached references are keyed by it.
OBSERVE_VERSION = "3"
# Reference runs merged per library: what differs between them is masked (object addresses differ
# in every run; the worker seeds `random` per test, so nothing else is expected to).
REFERENCE_RUNS = 3


def is_literal(node: ast.AST) -> bool:
    """An expression made only of constants and displays of constants: test data the tests spell out."""
    return all(isinstance(n, _LITERAL_NODES) for n in ast.walk(node))


def _observe_call(kind: str, how: ast.expr, operands: Sequence[ast.expr], loc: ast.AST) -> ast.stmt:
    mask = "".join("s" if is_literal(o) else "v" for o in operands)
    args: list[ast.expr] = [ast.Constant(kind), how, ast.Constant(mask)]
    args += [o for o in operands if not is_literal(o)]
    call = ast.Call(func=ast.Name(OBSERVE_NAME, ast.Load()), args=args, keywords=[])
    return ast.copy_location(ast.Expr(call), loc)


class _Rewriter(ast.NodeTransformer):
    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        t = node.test
        if is_literal(t):  # `assert False` / `assert 0`: a marker of unreachable code, nothing to hide
            return node
        if isinstance(t, ast.Compare) and all(type(op) in _CMP for op in t.ops):
            ops = ",".join(_CMP[type(op)] for op in t.ops)
            return _observe_call("cmp", ast.Constant(ops), [t.left, *t.comparators], node)
        if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
            return _observe_call("not", ast.Constant(""), [t.operand], node)
        return _observe_call("truth", ast.Constant(""), [t], node)

    def visit_Expr(self, node: ast.Expr) -> ast.stmt:
        c = node.value
        if (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                and c.func.value.id == "self" and c.func.attr.startswith("assert")
                and c.func.attr not in FLOW_ASSERTIONS and not any(isinstance(a, ast.Starred) for a in c.args)
                and all(k.arg is not None for k in c.keywords)):
            operands = list(c.args) + [k.value for k in c.keywords if k.arg != "msg"]
            # the bound assertion itself, for the worker to run when nothing was dropped
            return _observe_call("ut:" + c.func.attr, c.func, operands, node)
        return self.generic_visit(node)


def _observed(source: str) -> ast.Module | None:
    try:
        return ast.fix_missing_locations(_Rewriter().visit(ast.parse(source)))
    except (SyntaxError, ValueError, RecursionError):
        return None


def transform_modules(sources: Mapping[str, str]) -> dict[str, str]:
    """Test modules (path -> source) with assertions turned into observations and blinded together
    (blind.py: what they compute only to compare with is removed); a module that does not parse is
    left out (it is left as it is: it cannot run either)."""
    trees = {p: t for p, src in sources.items() if (t := _observed(src)) is not None}
    try:
        blind.blind(trees)
    except RecursionError:  # too deep to analyse: literal operands only are dropped
        trees = {p: t for p, src in sources.items() if (t := _observed(src)) is not None}
    out = {}
    for p, t in trees.items():
        try:
            out[p] = ast.unparse(t) + "\n"
        except RecursionError:
            pass
    return out


def transform_tests(source: str) -> str | None:
    """One test module transformed on its own (None: leave the file as it is)."""
    return transform_modules({"test_module.py": source}).get("test_module.py")


@functools.lru_cache(maxsize=16)  # the test files are the release's, the same in every grading of a library
def _transformed(files: tuple[tuple[str, bytes], ...]) -> tuple[tuple[str, bytes], ...]:
    got = transform_modules({p: b.decode("utf-8", "replace") for p, b in files})
    return tuple((p, t.encode("utf-8")) for p, t in sorted(got.items()))


def transform_tree(lib: L.Library, tree: Mapping[str, bytes]) -> dict[str, bytes]:
    """`tree` with every `.py` file under the library's test directories transformed (together:
    helpers shared between test modules are followed)."""
    out = dict(tree)
    files = tuple((p, tree[p]) for p in L.test_files(lib, dict(tree)) if p.endswith(".py"))
    out.update(dict(_transformed(files)))
    return out


# ----------------------------------------------------------------------------- the reference
@dataclass(frozen=True)
class Record:
    """One test's observations: canonical strings (None: differs between reference runs) and how it ended."""

    values: tuple[str | None, ...]
    end: str


@dataclass(frozen=True)
class Reference:
    """The pristine library's records, test by test; `unjudgeable`: tests whose two reference runs
    disagreed on the number of observations or on how they ended (judged by outcome only)."""

    records: Mapping[str, Record]
    unjudgeable: frozenset[str] = frozenset()

    def passed(self, nid: str, result) -> bool:
        """Whether test `nid` of `result` (a runner.SuiteResult) behaved as the reference did."""
        if nid in self.unjudgeable:  # (none in the four pinned suites: docs/swe.md)
            return result.outcomes.get(nid) == "passed"
        want = self.records.get(nid)
        got = result.observations.get(nid)
        if want is None:  # every test of a task passes on the pristine library, so it has a record
            return False
        if got is None:
            return False
        values, end = got
        if end != want.end or len(values) != len(want.values):
            return False
        return all(w is None or w == g for w, g in zip(want.values, values))

    def to_json(self) -> str:
        return json.dumps({"version": OBSERVE_VERSION, "unjudgeable": sorted(self.unjudgeable),
                           "records": {k: [list(r.values), r.end] for k, r in sorted(self.records.items())}})

    @staticmethod
    def from_json(text: str) -> "Reference":
        d = json.loads(text)
        recs = {str(k): Record(tuple(None if x is None else str(x) for x in v), str(e))
                for k, (v, e) in d["records"].items()}
        return Reference(recs, frozenset(str(x) for x in d["unjudgeable"]))


def merge_runs(*runs: Mapping[str, tuple[tuple[str, ...], str]]) -> Reference:
    """Reference runs into one: positions that differ between runs are masked (values derived from
    object addresses: `hash()` of an object, a default `repr`); a test whose count or end differs,
    or that is missing from a run, is unjudgeable."""
    recs: dict[str, Record] = {}
    unjudgeable: set[str] = set()
    for nid in set().union(*runs):
        if any(nid not in r for r in runs):
            unjudgeable.add(nid)
            continue
        got = [r[nid] for r in runs]
        if len({e for _, e in got}) > 1 or len({len(v) for v, _ in got}) > 1:
            unjudgeable.add(nid)
            continue
        first = got[0][0]
        recs[nid] = Record(tuple(x if all(v[i] == x for v, _ in got) else None for i, x in enumerate(first)), got[0][1])
    return Reference(recs, frozenset(unjudgeable))


def _cache_path(lib: L.Library) -> Path:
    from envs.swe import runner

    h = hashlib.sha256(OBSERVE_VERSION.encode() + Path(__file__).read_bytes() + runner.WORKER_SOURCE.encode()
                       + runner.JUDGE_SOURCE.encode() + str(L.interpreter()).encode()).hexdigest()[:16]
    return L.cache_root() / "observe" / f"{lib.key}-{h}.json"


_LOCK = threading.Lock()
_MEMO: dict[Path, Reference] = {}


def reference(backend, lib: L.Library, *, limits=None) -> Reference:
    """The pristine library's records (memoised, then cached on disk; two sandboxed runs to build)."""
    from envs.swe import grader as G
    from envs.swe import instances as I

    path = _cache_path(lib)
    with _LOCK:
        if path in _MEMO:
            return _MEMO[path]
        if path.is_file():
            ref = Reference.from_json(path.read_text())
        else:
            tree = transform_tree(lib, L.grading_files(lib, dict(I.pristine(lib.name))))
            runs = []
            for _ in range(REFERENCE_RUNS):
                res = G.run_in_sandbox(backend, lib, tree, **({"limits": limits} if limits else {}))
                if not res.ok:
                    raise RuntimeError(f"the reference run of {lib.key} gave no result: {res.problem} "
                                       f"{res.output_tail[-500:]}")
                runs.append(res.observations)
            ref = merge_runs(*runs)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                f.write(ref.to_json())
            os.replace(tmp, path)
            log.info("swe reference of %s: %d tests, %d unjudgeable", lib.key, len(ref.records), len(ref.unjudgeable))
        _MEMO[path] = ref
        return ref
