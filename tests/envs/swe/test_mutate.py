"""swe-v0 bug injection, test hiding and issue text: pure functions, no sandbox, no downloads.

Every mutation kind is checked against a hand-written expected module (the oracle is the text a
person would write for that bug, parsed independently), and every mutation of real stdlib modules
is checked to touch exactly one span on one line, to round-trip through revert, and to parse.
"""
from __future__ import annotations

import ast
import inspect
import random
from pathlib import Path

import pytest

from envs.swe.build import HiddenSpan, apply_hidden, hide_spans, issue_text, split_of
from envs.swe.libraries import LIBRARIES, Library
from envs.swe.mutate import KINDS, Mutation, enumerate_mutations
from envs.swe.runner import Failure


def changed_lines(before: str, after: str) -> list[int]:
    """1-based line numbers (of `before`) whose text differs; the edit must keep the line count."""
    a, b = before.splitlines(), after.splitlines()
    if len(a) != len(b):
        raise ValueError("the edit changed the number of lines")
    return [i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y]


SRC = '''\
import os

LIMIT = 3 < 4  # module level: never mutated


def window(seq, n=2, strict=False):
    """Docstring: 1 < 2 is not code."""
    if n < 1 or not seq:
        raise ValueError("n")
    out = []
    for i in range(0, len(seq) - n + 1):
        out.append(seq[i:i + n])
    total = 0
    total += len(out)
    if strict and total == 0:
        return False
    return out


class Box:
    def __init__(self, items, cap=8):
        self.items = list(items)
        self.cap = cap

    def full(self):
        return len(self.items) >= self.cap

    def pair(self):
        return self.cap, len(self.items)

    def has(self, x):
        return x in self.items and x is not None

    def scaled(self, k):
        return max(k * 2, self.cap)
'''


def _mut(kind: str, original: str, replacement: str, line: int) -> Mutation:
    ms = [m for m in enumerate_mutations("m.py", SRC)
          if m.kind == kind and m.original == original and m.replacement == replacement and m.line == line]
    assert len(ms) == 1, f"expected one {kind} {original!r}->{replacement!r} at line {line}, got {ms}"
    return ms[0]


def _expect(old_line: str, new_line: str) -> str:
    assert SRC.count(old_line) == 1
    return SRC.replace(old_line, new_line)


CASES = [  # kind, original, replacement, line, (old line, expected new line)
    ("flip_comparison", "<", ">", 8, ("    if n < 1 or", "    if n > 1 or")),
    ("flip_comparison", ">=", "<=", 26, ("len(self.items) >= self.cap", "len(self.items) <= self.cap")),
    ("flip_comparison", "in", "not in", 32, ("return x in self.items", "return x not in self.items")),
    ("flip_comparison", "is not", "is", 32, ("x is not None", "x is None")),
    ("off_by_one", "<", "<=", 8, ("    if n < 1 or", "    if n <= 1 or")),
    ("off_by_one", "1", "2", 11, ("len(seq) - n + 1)", "len(seq) - n + 2)")),
    ("off_by_one", "0", "1", 11, ("range(0, len", "range(1, len")),
    ("off_by_one", "2", "3", 35, ("max(k * 2, self.cap)", "max(k * 3, self.cap)")),
    ("swap_arguments", "k * 2, self.cap", "self.cap, k * 2", 35, ("max(k * 2, self.cap)", "max(self.cap, k * 2)")),
    ("remove_condition", "n < 1 or not seq", "n < 1", 8, ("if n < 1 or not seq:", "if n < 1:")),
    ("remove_condition", "not ", "", 8, ("or not seq:", "or seq:")),
    ("wrong_operator", "or", "and", 8, ("n < 1 or not seq", "n < 1 and not seq")),
    ("wrong_operator", "+", "-", 12, ("seq[i:i + n]", "seq[i:i - n]")),
    ("wrong_operator", "+=", "-=", 14, ("total += len(out)", "total -= len(out)")),
    ("wrong_default", "False", "True", 6, ("strict=False", "strict=True")),
    ("wrong_default", "8", "9", 21, ("cap=8", "cap=9")),
    ("wrong_return", "False", "True", 16, ("return False", "return True")),
    ("wrong_return", "out", "None", 17, ("    return out\n", "    return None\n")),
    ("wrong_return", "self.cap, len(self.items)", "len(self.items), self.cap", 29,
     ("return self.cap, len(self.items)", "return len(self.items), self.cap")),
]


@pytest.mark.parametrize("kind,original,replacement,line,lines", CASES, ids=[f"{c[0]}-{c[3]}-{c[2]}" for c in CASES])
def test_each_kind_matches_the_hand_written_bug(kind, original, replacement, line, lines):
    m = _mut(kind, original, replacement, line)
    got = m.apply(SRC)
    want = _expect(*lines)
    assert got == want
    assert ast.dump(ast.parse(got)) == ast.dump(ast.parse(want))
    assert changed_lines(SRC, got) == [line]
    assert m.revert(got) == SRC


def test_all_kinds_are_exercised_and_module_level_code_is_not_mutated():
    ms = enumerate_mutations("m.py", SRC)
    assert {m.kind for m in ms} == set(KINDS)
    assert all(m.line >= 6 for m in ms), "module-level statements (line 3) must not be mutated"
    assert {m.function for m in ms} == {"window", "Box.__init__", "Box.full", "Box.pair", "Box.has", "Box.scaled"}
    docstring_line = 7
    assert not [m for m in ms if m.line == docstring_line]


def test_positions_are_right_after_non_ascii_text():
    # ast columns count UTF-8 bytes, tokenize columns characters: an operator after "é" must still be found.
    src = 'def f(a, b):\n    s = "ééé"; return a < b\n'
    (m,) = [m for m in enumerate_mutations("u.py", src) if m.kind == "flip_comparison"]
    assert m.apply(src) == 'def f(a, b):\n    s = "ééé"; return a > b\n'


def test_parenthesised_operands_keep_their_brackets():
    src = "def f(a, b):\n    return (a) < (b + 1)\n"
    got = {m.apply(src) for m in enumerate_mutations("p.py", src) if m.kind == "flip_comparison"}
    assert got == {"def f(a, b):\n    return (a) > (b + 1)\n"}


def test_apply_refuses_a_source_that_does_not_match():
    m = _mut("wrong_default", "8", "9", 21)
    with pytest.raises(ValueError, match="expected '8'"):
        m.apply(SRC.replace("cap=8", "cap=7"))
    with pytest.raises(ValueError, match="expected '9'"):
        m.revert(SRC)


def test_syntax_error_names_the_file():
    with pytest.raises(SyntaxError, match="bad.py"):
        enumerate_mutations("bad.py", "def f(:\n")


@pytest.mark.parametrize("module", ["bisect", "heapq", "textwrap", "fnmatch"])
def test_every_mutation_of_a_real_module_is_one_span_on_one_line(module):
    import importlib

    src = Path(inspect.getsourcefile(importlib.import_module(module))).read_text()
    ms = enumerate_mutations(f"{module}.py", src)
    assert len(ms) > 20
    base = ast.dump(ast.parse(src))
    for m in random.Random(0).sample(ms, min(80, len(ms))):
        new = m.apply(src)
        assert new[:m.start] == src[:m.start] and new[m.start + len(m.replacement):] == src[m.end:]
        assert len(changed_lines(src, new)) == 1, m.describe()
        assert ast.dump(ast.parse(new)) != base, m.describe()
        assert m.revert(new) == src


# ----------------------------------------------------------------------------- hiding tests
TESTS = '''\
import pytest


def test_a():
    assert 1


@pytest.mark.parametrize("x", [1, 2])
def test_b(x):
    assert x


class TestOnly:
    def test_c(self):
        assert 1


class TestTwo:
    def test_d(self):
        assert 1

    def test_e(self):
        assert 1
'''


def test_hide_spans_removes_exactly_the_failing_tests():
    locs = {"t.py::test_b[1]": ("t.py", 8), "t.py::test_b[2]": ("t.py", 8), "t.py::TestOnly::test_c": ("t.py", 14),
            "t.py::TestTwo::test_e": ("t.py", 22)}
    spans = hide_spans({"t.py": TESTS}, list(locs), locs)
    assert spans == (HiddenSpan("t.py", 8, 10), HiddenSpan("t.py", 14, 15, "    pass"), HiddenSpan("t.py", 22, 23))
    out = apply_hidden(TESTS, spans)
    tree = ast.parse(out)
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert names == {"test_a", "test_d"}
    assert "class TestOnly:\n    pass\n" in out


def test_hide_spans_refuses_tests_it_cannot_locate():
    assert hide_spans({"t.py": TESTS}, ["t.py::gen"], {"t.py::gen": ("t.py", 2)}) is None
    assert hide_spans({"t.py": TESTS}, ["x.py::t"], {"x.py::t": ("x.py", 1)}) is None
    assert hide_spans({"t.py": TESTS}, ["t.py::test_a"], {}) is None


# ----------------------------------------------------------------------------- issue text and split
def test_issue_text_uses_test_names_messages_and_library_frames_only():
    lib = LIBRARIES["toolz"]
    f2p = ["toolz/tests/test_x.py::test_take", "toolz/tests/test_x.py::test_peek"]
    fails = {f2p[0]: Failure("AssertionError: assert [1] == [1, 2]",
                             (("<outside>/python.py", 187, "pytest_pyfunc_call"),
                              ("toolz/tests/test_x.py", 10, "test_take"), ("toolz/itertoolz.py", 322, "take")))}
    text = issue_text(lib, f2p, fails, random.Random(0))
    assert "test_take fails (and 1 more test)" in text
    assert "assert [1] == [1, 2]" in text
    assert 'File "toolz/itertoolz.py", line 322, in take' in text
    assert "pytest_pyfunc_call" not in text and "<outside>" not in text
    assert "`toolz/tests/test_x.py::test_peek`" in text
    assert set(inspect.signature(issue_text).parameters) == {"lib", "f2p", "failures", "rng"}  # no mutation input


def test_split_is_by_function_and_about_a_fifth_held_out():
    keys = [f"lib:mod.py:f{i}" for i in range(2000)]
    held = [k for k in keys if split_of(k) == "heldout"]
    assert 0.15 < len(held) / len(keys) < 0.25
    assert all(split_of(k) == split_of(k) for k in keys[:50])


def test_library_paths_exclude_tests_and_startup_hooks():
    lib: Library = LIBRARIES["toolz"]
    assert lib.is_library_path("toolz/itertoolz.py")
    assert lib.is_library_path("toolz/new_helper.py")
    for p in ("toolz/tests/test_itertoolz.py", "toolz/conftest.py", "conftest.py", "toolz/sitecustomize.py",
              "sitecustomize.py", "pytest.py", "toolz/x.pth", "toolz/tests/helper.py", "setup.cfg",
              "toolz/usercustomize.py", "shadow/toolz/itertoolz.py"):
        assert not lib.is_library_path(p), p
    assert LIBRARIES["cachetools"].is_library_path("src/cachetools/keys.py")
    assert not LIBRARIES["cachetools"].is_library_path("cachetools/keys.py")
