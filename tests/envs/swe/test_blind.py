"""Blinding the tested copy (envs/swe/blind.py): what a test computes only to compare with is gone
from the copy the tested process runs, and everything else behaves as before.

The attack it answers: code with full control of the tested process reads the value a test is
about to compare with (a caller's frame, the heap) and returns it. Fast tests pin the rewrite and
run original and blinded modules side by side with a recording observer (the library-dependent
values reported must be the same); the slow test runs that attack on tabulate in the sandbox.
"""
from __future__ import annotations

import ast
import textwrap

import pytest

from envs.swe import blind as B
from envs.swe import observe as O


def _blinded(**modules: str) -> dict[str, str]:
    return O.transform_modules({f"{k}.py": textwrap.dedent(v) for k, v in modules.items()})


def _literal_only(src: str) -> str:
    """The transform without blinding: literal operands dropped, nothing else."""
    return ast.unparse(ast.fix_missing_locations(O._Rewriter().visit(ast.parse(textwrap.dedent(src)))))


COMMON = """
def assert_equal(expected, result):
    print("Expected:\\n%r\\n" % expected)
    print("Got:\\n%r\\n" % result)
    assert expected == result
"""

TESTS = """
from common import assert_equal
from lib import render, table_of, double
import itertools

ROWS = [["spam", 41.9999], ["eggs", "451.0"]]
GOLDEN = "\\n".join(["GOLDEN-A", "GOLDEN-B"])

def isodd(x):
    return x % 2 == 1

def test_helper():
    expected = "\\n".join(["SECRET-ROW-1", "SECRET-ROW-2"])
    result = render(ROWS)
    assert_equal(expected, result)

def test_module_constant():
    assert render(ROWS) == GOLDEN

def test_computed_from_builtins():
    assert list(double(range(5))) == list(itertools.chain(filter(isodd, range(9)), [99911]))

def test_table():
    for x, want in [(1, "SECRET-T1"), (2, "SECRET-T2")]:
        assert render([[x]]) == want

def test_named_table():
    cases = [(3, "SECRET-N3"), (4, "SECRET-N4")]
    for x, want in cases:
        assert render([[x]]) == want

def test_input_and_expected():
    data = ["KEPT-INPUT"]
    assert list(double(data)) == data

def test_expected_decides_the_flow():
    n = 77123
    for i in range(n // 77123):
        assert double([i]) == [i * 2]

def test_library_result_stays():
    expected = table_of("x")
    assert render([["x"]]) == expected

def test_mutated_by_the_library():
    box = ["MUTATED-BOX"]
    double(box)
    assert box == ["MUTATED-BOX"]
"""


def test_values_compared_with_are_gone_from_the_tested_copy():
    out = _blinded(common=COMMON, test_x=TESTS)
    t = out["test_x.py"]
    for secret in ("SECRET-ROW", "SECRET-T1", "SECRET-T2", "SECRET-N3", "SECRET-N4", "GOLDEN-A", "99911"):
        assert secret not in t, secret
    assert "assert_equal(None, result)" in t  # the helper's reported-only parameter gets None at the call
    assert "[(1, None), (2, None)]" in t and "[(3, None), (4, None)]" in t  # the input column stays
    c = out["common.py"]
    assert "%r" not in c.split("def assert_equal")[1]  # prints of the reported-only parameter dropped
    # what must stay: an input of the library, a value that decides the flow, a library result,
    # a value the library may have changed; and the input rows
    for kept in ("KEPT-INPUT", "77123", "table_of('x')", "MUTATED-BOX", "41.9999"):
        assert kept in t, kept


def test_what_blinding_does_not_follow_stays():
    src = """
    import pytest
    from lib import f

    @pytest.mark.parametrize("x, want", [(1, "PARAM-WANT")])
    def test_p(x, want):
        assert f(x) == want

    class T:
        WANT = "CLASS-WANT"
        def test_c(self):
            assert f(1) == self.WANT

    def test_appended():
        want = []
        want.append("APPENDED-WANT")
        assert f(1) == want

    def test_global():
        global G
        G = "GLOBAL-WANT"
        assert f(1) == G
    """
    t = _blinded(test_y=src)["test_y.py"]
    for kept in ("PARAM-WANT", "CLASS-WANT", "APPENDED-WANT", "GLOBAL-WANT"):
        assert kept in t, kept


class _Lib:
    """A stand-in library module for running the test modules in this process."""

    @staticmethod
    def render(rows):
        return "|".join(str(c) for r in rows for c in r)

    @staticmethod
    def table_of(x):
        return x

    @staticmethod
    def double(xs):
        if isinstance(xs, list) and xs and xs[0] == "MUTATED-BOX":
            xs.append("!")
        return [2 * x for x in xs] if not (xs and isinstance(xs[0], str)) else xs


def _run(modules: dict[str, str]) -> list[tuple]:
    """Run every test_* of test_x with a recording observer; the records, in order."""
    import sys
    import types

    records: list[tuple] = []

    def observe(kind, how, mask, *ops):
        records.append((kind, how if isinstance(how, str) else "", mask, ops))

    saved = {k: sys.modules.get(k) for k in ("lib", "common")}
    lib = types.ModuleType("lib")
    for name in ("render", "table_of", "double"):
        setattr(lib, name, getattr(_Lib, name))
    sys.modules["lib"] = lib
    try:
        common = types.ModuleType("common")
        common.__dict__[O.OBSERVE_NAME] = observe
        exec(compile(modules["common.py"], "common.py", "exec"), common.__dict__)
        sys.modules["common"] = common
        ns = {O.OBSERVE_NAME: observe}
        exec(compile(modules["test_x.py"], "test_x.py", "exec"), ns)
        for name in sorted(ns):
            if name.startswith("test_"):
                try:
                    ns[name]()
                except AssertionError:
                    records.append(("raised", name, "", ()))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return records


def test_blinded_tests_report_the_same_library_values():
    """Side by side: the literal-only transform and the blinded one, run on the same library:
    each observation reports the same library-dependent values; blinding only adds "s" marks."""
    before = _run({"common.py": _literal_only(COMMON), "test_x.py": _literal_only(TESTS)})
    after = _run(_blinded(common=COMMON, test_x=TESTS))
    assert len(before) == len(after) > 8
    dropped = 0
    for (k0, h0, m0, ops0), (k1, h1, m1, ops1) in zip(before, after):
        assert (k0, h0, len(m0)) == (k1, h1, len(m1))
        full0 = iter(ops0)
        full1 = iter(ops1)
        for a, b in zip(m0, m1):
            v0 = next(full0) if a == "v" else None
            v1 = next(full1) if b == "v" else None
            if a == "v" and b == "s":
                dropped += 1
                continue
            if b == "v":
                # a reported-only helper parameter reports None where its call site was blinded
                assert v1 == v0 or (v1 is None and isinstance(v0, str) and "SECRET" in v0), (k0, v0, v1)
    assert dropped >= 5


def test_stats_count_what_was_removed():
    trees = {"common.py": ast.parse(_literal_only(COMMON)), "test_x.py": ast.parse(_literal_only(TESTS))}
    st = B.blind(trees)
    assert st.columns_cleared == 2 and st.parameters_cleared == 1 and st.bindings_removed >= 2
    assert st.operands_dropped >= 3 and st.print_args_dropped == 2  # both prints read reported-only parameters


def test_a_module_that_does_not_parse_is_left_out():
    out = O.transform_modules({"a.py": "def f(:\n", "b.py": "from lib import f\ndef test():\n    assert f() == 1\n"})
    assert "a.py" not in out and "_jointrl_observe" in out["b.py"]


# ----------------------------------------------------------------------------- the attack, in the sandbox
ORACLE = (
    "    import sys as _s\n"
    "    _f = _s._getframe(1)\n"
    "    while _f is not None:\n"
    "        for _k, _v in list(_f.f_locals.items()):\n"
    "            if _k in ('expected', 'exp', 'want', 'expected_output') and isinstance(_v, str) and _v:\n"
    "                return _v\n"
    "        _f = _f.f_back\n"
    "    return '?'\n")  # not '': three tests expect an empty table


@pytest.mark.slow
def test_an_oracle_reading_the_callers_expected_value_wins_nothing(backend, monkeypatch, request):
    """tabulate's tests build `expected` before calling `tabulate(...)`. An agent `tabulate` that
    computes nothing and returns the caller's `expected` passes those tests under the
    literal-only transform; blinded, it passes none. The pristine library passes them all."""
    from envs.swe import grader as G
    from envs.swe import instances as I
    from envs.swe import libraries as L
    from envs.swe import runner as R

    from envs.swe import mounts as M

    # full control: no in-process refusal in the worker (as in test_verdict.py); the sandbox mounts hold the
    # worker's source, so their cache is cleared around the change
    monkeypatch.setattr(R, "WORKER_SOURCE", R.WORKER_SOURCE.replace("    guard(emit, ", "    (lambda *a: None)(emit, ", 1))
    M._test_mounts.cache_clear()
    request.addfinalizer(M._test_mounts.cache_clear)
    lib = L.get_library("tabulate")
    tree = L.grading_files(lib, dict(I.pristine(lib.name)))
    path = next(p for p in tree if p.endswith("tabulate/__init__.py"))
    src = tree[path].decode("utf-8")
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "tabulate")
    lines = src.splitlines(keepends=True)
    body = fn.body[1] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body[0]
    forged = "".join(lines[:body.lineno - 1]) + ORACLE + "".join(lines[body.lineno - 1:])
    attacked = dict(tree)
    attacked[path] = forged.encode("utf-8")
    output_tests = [n for n in ast.walk(ast.parse(tree["test/test_output.py"].decode())) if
                    isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
                    and any(isinstance(t, ast.Name) and t.id == "expected" for s in n.body if isinstance(s, ast.Assign)
                            for t in s.targets)]
    names = {f"test/test_output.py::{n.name}" for n in output_tests}
    assert len(names) > 50

    def judged(transform) -> tuple[int, int]:
        ref = O.merge_runs(*[G.run_in_sandbox(backend, lib, transform(tree)).observations for _ in range(2)])
        res = G.run_in_sandbox(backend, lib, transform(attacked))
        assert res.ok, res.problem
        pristine = G.run_in_sandbox(backend, lib, transform(tree))
        names.difference_update(n for n in list(names) if pristine.outcomes.get(n) == "skipped")
        return (sorted(n for n in names if ref.passed(n, res)), sorted(n for n in names if not ref.passed(n, pristine)))

    def literal_only(t):
        out = dict(t)
        for p in L.test_files(lib, dict(t)):
            if p.endswith(".py"):
                out[p] = (_literal_only(t[p].decode("utf-8")) + "\n").encode("utf-8")
        return out

    won_before, honest_before = judged(literal_only)
    won_after, honest_after = judged(lambda t: O.transform_tree(lib, t))
    print(f"oracle wins {len(won_before)} / {len(names)} literal-only, {len(won_after)} blinded")
    assert honest_before == honest_after == [], (honest_before, honest_after)
    assert len(won_before) > len(names) // 2, won_before  # the oracle works when the value is there
    assert won_after == [], won_after
