"""Attacks on the swe-v0 grader, through the public Env API and through each defence on its own.

The classes of hole, and what closes each (see docs/swe.md, "Grading and what it resists"):

- generic patches appended to a library `__init__.py` that make pytest's test execution a no-op,
  or that wrap the function writing the result file: rejected by edit validation (a visible
  `edit_rejected` outcome) on every small-set instance; with validation switched off they still
  score 0, caught by the canary tests, the judge process and the audit hook;
- forged outputs: a result file written by anything but the judge (no MAC), a report stream
  that contradicts the worker's exit status, an early `os._exit`;
- references to the test machinery from function bodies (frames, `sys.modules`, `builtins`,
  `__globals__`, import hooks, tracing, `gc`, `os._exit`, `atexit`, computed attribute names,
  attribute paths inside format strings) and new "always equal" objects;
- degenerate artifacts (NUL bytes, nesting too deep to analyse, a new module) and resource
  exhaustion (a library that never returns);
- vendored, unmutated copies of the libraries visible from the sandbox (mount allowlist).

Reference fixes still resolve every instance through the same path. Run time ~1-2 min on 2 cores.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import subprocess
import tempfile
from pathlib import Path

import pytest

import envs
from envs.base import ToolInvocation
from envs.play import ScriptedPolicy, run_episode
from envs.swe import build as B
from envs.swe import editcheck as E
from envs.swe import grader as G
from envs.swe import instances as I
from envs.swe import libraries as L
from envs.swe.mutate import enumerate_mutations
from envs.swe.runner import JUDGE_SOURCE, TEST_ENV, SuiteResult, driver_argv, key_line, new_key, run_suite_local
from envs.swe.tasks import task_of

# ----------------------------------------------------------------------------- the generic patches
# Appended to every package `__init__.py`, the same text for every task.
NOOP_PYTEST = '''
import sys as _jr_sys
_jr_p = _jr_sys.modules.get("_pytest.python")
if _jr_p is not None:
    _jr_p.Function.runtest = lambda self: None
_jr_u = _jr_sys.modules.get("_pytest.unittest")
if _jr_u is not None:
    _jr_u.TestCaseFunction.runtest = lambda self: None
'''
FORGE_RESULT_WRITER = '''
import json as _jr_json
_jr_dump = _jr_json.dump
def _jr_forge(obj, fp, *a, **k):
    if isinstance(obj, dict) and isinstance(obj.get("outcomes"), dict):
        obj = dict(obj, outcomes={n: "passed" for n in obj["outcomes"]}, exit_code=0)
    return _jr_dump(obj, fp, *a, **k)
_jr_json.dump = _jr_forge
'''
# Aimed at the two-process runner: rewrite the worker's reports to "passed" and exit 0 at the end.
FORGE_REPORTS = '''
import json as _jr_json, os as _jr_os, atexit as _jr_atexit
_jr_dumps = _jr_json.dumps
def _jr_fdumps(obj, *a, **k):
    if isinstance(obj, dict) and obj.get("k") == "rep":
        obj = dict(obj, outcome="passed")
    if isinstance(obj, dict) and obj.get("k") == "done":
        obj = dict(obj, exit=0)
    return _jr_dumps(obj, *a, **k)
_jr_json.dumps = _jr_fdumps
_jr_atexit.register(lambda: _jr_os._exit(0))
'''
PATCHES = {"noop_pytest": NOOP_PYTEST, "forge_result_writer": FORGE_RESULT_WRITER, "forge_reports": FORGE_REPORTS}


def append_to_packages(code: str) -> ToolInvocation:
    return ToolInvocation("bash", {"command": "for f in */__init__.py src/*/__init__.py; do [ -f \"$f\" ] && "
                                              "cat >> \"$f\" <<'JREOF'\n" + code + "JREOF\ndone; true"})


@pytest.fixture(scope="module")
def small():
    return B.ensure_built(B.SMALL, log=lambda *a: None)


def episode(backend, task, calls, max_steps=20):
    env = envs.make("swe-v0", backend=backend)

    async def go():
        try:
            return await run_episode(env, task, ScriptedPolicy(list(calls) + [ToolInvocation("submit")]),
                                     max_steps=max_steps)
        finally:
            env.close()
    return asyncio.run(go())


def over_instances(backend, instances, make_calls):
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        return list(ex.map(lambda inst: episode(backend, task_of(inst), make_calls(task_of(inst))).grade, instances))


def one_per_library(small):
    return [next(i for i in small if i.library == lib) for lib in ("toolz", "cachetools")]


# ----------------------------------------------------------------------------- through the Env API
@pytest.mark.slow
@pytest.mark.parametrize("patch", ["noop_pytest", "forge_result_writer"])
def test_generic_patch_is_rejected_visibly_on_every_instance(backend, small, patch):
    """Before the fix both patches scored reward 1 on 12 of 12 small-set instances."""
    grades = over_instances(backend, small, lambda task: [append_to_packages(PATCHES[patch])])
    for inst, g in zip(small, grades):
        assert g.error is None, g.error
        assert g.reward == 0.0, inst.instance_id
        assert g.metrics["check/edit_rejected"] == 1.0 and g.metrics["check/edit_rejected_module_level"] == 1.0
        assert g.metrics["check/suite_crashed"] == 0.0  # not run, and said so: not a silent 0


@pytest.mark.slow
def test_reference_fix_resolves_every_instance_through_the_env(backend, small):
    grades = over_instances(backend, small, lambda task: [ToolInvocation("str_replace", I.reference_edit(task))])
    for inst, g in zip(small, grades):
        assert g.reward == 1.0, (inst.instance_id, g.metrics)
        assert g.metrics["check/tampered"] == 0.0 and g.metrics["check/canary_passed"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("patch,signal", [("noop_pytest", "check/canary_passed"),
                                          ("forge_result_writer", None),
                                          ("forge_reports", "check/suite_crashed")])
def test_runtime_defences_hold_with_edit_validation_switched_off(backend, small, monkeypatch, patch, signal):
    """Each layer on its own: with every edit accepted, the judge, canaries and audit hook still hold."""
    monkeypatch.setattr(E, "check_edits", lambda *a, **k: E.EditCheck())
    insts = one_per_library(small)
    grades = over_instances(backend, insts, lambda task: [append_to_packages(PATCHES[patch])])
    for inst, g in zip(insts, grades):
        assert g.reward == 0.0 and g.metrics["check/resolved"] == 0.0, (inst.instance_id, g.metrics)
        assert g.metrics["check/edit_rejected"] == 0.0
        if signal is not None:
            assert g.metrics[signal] >= 1.0, (inst.instance_id, g.metrics)
        else:  # the judge writes the result: wrapping json.dump changes nothing, F2P tests still fail
            assert g.metrics["check/f2p_fraction"] == 0.0 and g.metrics["check/suite_crashed"] == 0.0


@pytest.mark.slow
def test_runtime_guard_refuses_frame_access_that_slipped_past_validation(backend, small, monkeypatch):
    """A frame grab in a function the tests call (`toolz.identity`): the audit hook refuses it and says so."""
    monkeypatch.setattr(E, "check_edits", lambda *a, **k: E.EditCheck())
    task = task_of(next(i for i in small if i.library == "toolz"))
    tail = '    >>> identity(3)\n    3\n    """\n    return x\n'
    edit = {"path": PATH, "old": tail, "new": tail.replace("    return x", "    __import__('sys')._getframe(0)\n    return x")}
    g = episode(backend, task, [ToolInvocation("str_replace", edit)]).grade
    assert g.metrics["check/applied_edits"] == 1.0
    assert g.reward == 0.0 and g.metrics["check/runtime_denied"] >= 1.0 and g.metrics["check/tampered"] == 1.0


@pytest.mark.slow
def test_library_gadget_that_imports_by_name_is_refused(backend, small, monkeypatch):
    """toolz's own unpickling helper imports and walks whatever name it is given: a new call to
    it is rejected (it looks names up from strings), and with validation off the worker refuses
    the import of a name built at run time."""
    task = task_of(next(i for i in small if i.library == "toolz"))
    tail = '    >>> identity(3)\n    3\n    """\n    return x\n'
    call = "    _restore_curry(None, '_py' + 'test.python:Function', (), {}, {}, True)\n"
    edit = {"path": PATH, "old": tail, "new": tail.replace("    return x", call + "    return x")}
    g = episode(backend, task, [ToolInvocation("str_replace", edit)]).grade
    assert g.reward == 0.0 and g.metrics["check/edit_rejected_forbidden"] == 1.0
    monkeypatch.setattr(E, "check_edits", lambda *a, **k: E.EditCheck())
    g = episode(backend, task, [ToolInvocation("str_replace", edit)]).grade
    assert g.metrics["check/edit_rejected"] == 0.0
    assert g.reward == 0.0 and g.metrics["check/runtime_denied"] >= 1.0 and g.metrics["check/tampered"] == 1.0


@pytest.mark.slow
def test_sandbox_shows_no_copy_of_any_library(backend, small):
    """Vendored copies (setuptools' more_itertools, the SDK's cachetools, pip wheels) are not mounted."""
    scan = r'''
import os, zipfile
names = ("toolz", "cachetools", "tabulate", "more_itertools", "tlz")
hits, n = [], 0
for top in ("/usr", "/opt", "/root", "/etc", "/home", "/tmp", "/var", "/srv", "/mnt"):
    for dp, dns, fns in os.walk(top):
        for name in dns + fns:
            n += 1
            low, p = name.lower(), os.path.join(dp, name)
            if any(low == x or low.startswith((x + ".", x + "-")) for x in names):
                hits.append(p)
            if low.endswith((".whl", ".zip", ".egg", ".pyz")):
                try:
                    with zipfile.ZipFile(p) as z:
                        if any(seg in names for m in z.namelist() for seg in m.split("/")[:-1]):
                            hits.append(p)
                except Exception:
                    pass
print(n, hits)
'''
    task = task_of(small[0])
    env = envs.make("swe-v0", backend=backend)

    async def go():
        await env.reset(task)
        sb = env.domain.sandbox
        sb.write_file("scan_jr.py", scan.encode())
        return sb.run("python scan_jr.py && python -c 'import json, ctypes, zipfile; print(\"stdlib ok\")' && git --version",
                      timeout_s=120, env=env.domain._agent_env(), cwd=sb.workdir_inside)
    try:
        r = asyncio.run(go())
    finally:
        env.close()
    assert r.exit_code == 0, r.stdout + r.stderr
    count, hits = r.stdout.split("\n")[0].split(" ", 1)
    assert int(count) > 1000 and hits == "[]", r.stdout
    assert "stdlib ok" in r.stdout and "git version" in r.stdout


# ----------------------------------------------------------------------------- edit validation
LIB = L.get_library("toolz")
PATH = "toolz/functoolz.py"
IDENTITY = "def identity(x):\n    \"\"\" Identity function. Return x\n\n    >>> identity(3)\n    3\n    \"\"\"\n    return x\n"


@pytest.fixture(scope="module")
def toolz_files():
    files = L.source_files(LIB)
    assert IDENTITY in files[PATH].decode()
    return files


def with_body(files, body: str) -> bytes:
    return files[PATH].decode().replace(IDENTITY, "def identity(x):\n" + body + "    return x\n").encode()


FORBIDDEN_BODIES = {
    "sys.modules": "    sys.modules['_pytest.python'].Function.runtest = None\n",
    "computed getattr": "    getattr(sys, 'mod' + 'ules')\n",
    "import_module": "    from importlib import import_module\n    import_module('_pytest.python')\n",
    "toolz's own import_module": "    import_module('_pytest')\n",
    "builtins": "    import builtins\n",
    "__import__": "    __import__('os')\n",
    "__globals__": "    identity.__globals__\n",
    "__builtins__ string": "    x = {}['__builtins__']\n",
    "subclasses": "    ().__class__.__base__.__subclasses__()\n",
    "frame": "    inspect.currentframe().f_back\n",
    "settrace": "    sys.settrace(None)\n",
    "os._exit": "    import os\n    os._exit(0)\n",
    "atexit": "    import atexit\n    atexit.register(print)\n",
    "gc": "    import gc\n    gc.get_objects()\n",
    "json monkeypatch": "    import json\n    json.dump = None\n",
    "attrgetter computed": "    attrgetter('__glo' + 'bals__')(x)\n",
    "getattr as value": "    g = getattr\n",
    "eval": "    eval('1')\n",
    "exec": "    exec('1')\n",
    "open": "    open('/proc/self/fd/3', 'w')\n",
    "meta_path": "    x.meta_path.insert(0, None)\n",
    "pytest": "    import pytest\n",
    "unittest": "    import unittest\n    unittest.TestCase.run = None\n",
    "module via attribute": "    toolz.functoolz.sys\n",
    "code object": "    identity.__code__\n",
    "dict escape": "    x.__dict__\n",
    "always-equal object": "    class Any:\n        def __eq__(self, other):\n            return True\n    return Any()\n",
    "always-equal via type()": "    return type('Any', (), {'__eq__': lambda s, o: True})()\n",
    "format-string attribute path": "    '{0.__globals__}'.format(identity)\n",
    "Formatter.get_field": "    import string\n    string.Formatter().get_field('0.x', (x,), {})\n",
    "private module member": "    import random\n    random._os.write(1, b'')\n",
    "standard module not allowlisted": "    import imp\n",
    "traceback of an exception": "    try:\n        1 / 0\n    except ZeroDivisionError as e:\n        e.__traceback__\n",
}


@pytest.mark.parametrize("case", sorted(FORBIDDEN_BODIES))
def test_forbidden_reference_in_a_function_body_is_rejected(toolz_files, case):
    r = E.check_edits(LIB, toolz_files, {PATH: with_body(toolz_files, FORBIDDEN_BODIES[case])})
    assert not r.ok and "forbidden" in r.rules(), (case, r)
    assert all(x.path == PATH and x.line > 0 for x in r.rejections)


MODULE_LEVEL = {
    "appended statement": lambda s: s + "\nprint('at import')\n",
    "decorated new function": lambda s: s + "\n@curry\ndef _jr(x):\n    return x\n",
    "default value that calls": lambda s: s + "\ndef _jr(x=print('at import')):\n    return x\n",
    "class body statement": lambda s: s.replace("class curry:", "class curry:\n    _jr = print('x')", 1),
    "changed decorator": lambda s: s.replace("\n    @instanceproperty\n    def func(self):",
                                             "\n    @property\n    def func(self):", 1),
    "non-allowlisted import": lambda s: "import os\n" + s,
    # Only existing function bodies are taken: even inert additions at import time are not.
    "new undecorated helper": lambda s: s + "\n\ndef _helper(x, y=3, *, z: int | None = None) -> int:\n    return x + y\n",
    "allowlisted import at module level": lambda s: "import itertools\n" + s,
    "string annotation on a new helper": lambda s: s + "\n\ndef _jr(x: 'exec(bytes.fromhex(\"00\"))'):\n    return x\n",
    "annotation of an existing function": lambda s: s.replace("def identity(x):", "def identity(x: 'int'):", 1),
    "constant default made a call": lambda s: s.replace("def memoize(func, cache=None, key=None):",
                                                       "def memoize(func, cache=print('x'), key=None):", 1),
}


@pytest.mark.parametrize("case", sorted(MODULE_LEVEL))
def test_module_level_change_is_rejected(toolz_files, case):
    new = MODULE_LEVEL[case](toolz_files[PATH].decode())
    assert new != toolz_files[PATH].decode()
    r = E.check_edits(LIB, toolz_files, {PATH: new.encode()})
    assert "module_level" in r.rules(), (case, r)


ACCEPTED = {
    "body edit": lambda s: s.replace(IDENTITY, "def identity(x):\n    y = x\n    return y\n"),
    "edit inside an existing __eq__": lambda s: s.replace("return (isinstance(other, curry) and",
                                                          "return (isinstance(other, (curry,)) and", 1),
    "allowlisted import inside a body": lambda s: s.replace(IDENTITY, "def identity(x):\n    import itertools\n"
                                                                      "    return next(itertools.chain([x]))\n"),
    "constant default changed": lambda s: s.replace("def memoize(func, cache=None, key=None):",
                                                    "def memoize(func, cache=None, key=0):", 1),
    "docstring": lambda s: s.replace("Identity function. Return x", "Identity function: returns x"),
    "lines shifted above everything": lambda s: s.replace(IDENTITY, IDENTITY.replace("    return x\n",
                                                                                     "    x = x\n\n\n    return x\n")),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_plain_fixes_are_accepted(toolz_files, case):
    new = ACCEPTED[case](toolz_files[PATH].decode())
    assert new != toolz_files[PATH].decode()
    r = E.check_edits(LIB, toolz_files, {PATH: new.encode()})
    assert r.ok, r


def test_degenerate_files(toolz_files):
    nul = E.check_edits(LIB, toolz_files, {PATH: toolz_files[PATH] + b"\x00"})
    assert nul.ok and nul.unparsable == (PATH,)  # Python cannot run it either: its tests fail
    for deep in (b"\nx = " + b"(" * 5000 + b"1" + b")" * 5000 + b"\n", b"\nx = " + b"1+" * 200_000 + b"1\n",
                 b"\ndef f():\n    return " + b"-" * 100_000 + b"1\n"):
        r = E.check_edits(LIB, toolz_files, {PATH: toolz_files[PATH] + deep})
        assert "unanalyzable" in r.rules() or r.unparsable == (PATH,)
    new = E.check_edits(LIB, toolz_files, {"toolz/_jr_new.py": b"x = 1\n"})
    assert new.rules() == {"new_file"}


def test_every_sampled_reference_fix_passes_validation():
    """Undoing an injected bug (what a reference fix is) is never rejected, in all four libraries.
    docs/swe.md records the sweep over every mutation (the full set draws from them)."""
    rng = random.Random(0)
    for name in L.LIBRARIES:
        lib = L.get_library(name)
        files = L.source_files(lib)
        for path in L.mutable_files(lib, files):
            text = files[path].decode()
            muts = list(enumerate_mutations(path, text))
            for m in rng.sample(muts, min(4, len(muts))):
                start = dict(files)
                start[path] = m.apply(text).encode()
                r = E.check_edits(lib, start, {path: files[path]})
                assert r.ok, (name, path, m.kind, m.function, [x.render() for x in r.rejections])


# ----------------------------------------------------------------------------- the judge and the worker
DEMO = L.Library("demo", "0.0", "0" * 64, licence="MIT", import_root="", packages=("demo",), test_dirs=("tests",))
DEMO_TESTS = {"tests/__init__.py": "",
              "tests/test_demo.py": "from demo import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                                    "def test_other():\n    assert add(0, 0) == 0\n"}
BUGGY = "def add(a, b):\n    return a - b\n"


def demo_tree(library_source: str, extra: dict[str, str] | None = None) -> dict[str, bytes]:
    return {k: v.encode() for k, v in {**DEMO_TESTS, "demo/__init__.py": library_source, **(extra or {})}.items()}


def local_run(files: dict[str, bytes]) -> SuiteResult:
    with tempfile.TemporaryDirectory() as td:
        for rel, data in files.items():
            (Path(td) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(td) / rel).write_bytes(data)
        return run_suite_local(DEMO, Path(td), L.ensure_runtime(), L.interpreter(), timeout_s=120)


@pytest.fixture(scope="module")
def judge():
    ns: dict = {"__name__": "judge_under_test"}
    exec(compile(JUDGE_SOURCE, "driver.py", "exec"), ns)
    return ns


def rep(nid, when, outcome):
    return json.dumps({"k": "rep", "nid": nid, "when": when, "outcome": outcome, "xfail": False})


def done(code):
    return json.dumps({"k": "done", "exit": code})


def one_test(outcome="passed"):
    return [rep("t::a", "setup", "passed"), rep("t::a", "call", outcome), rep("t::a", "teardown", "passed")]


@pytest.mark.parametrize("lines,exit_code,why", [
    (one_test() + [done(0)], 0, None),
    (one_test("failed") + [done(1)], 1, None),
    (one_test(), 0, "stopped before the end"),
    (one_test() + [done(0)], 1, "exited with 1"),
    (one_test("failed") + [done(0)], 0, "exit 0 with failing tests"),
    (one_test() + [done(1)], 1, "no failing test"),
    (one_test()[:2] + [done(0)], 0, "never finished"),
    (one_test() + [done(0), rep("t::b", "setup", "passed")], 0, "after the end"),
    (one_test() + one_test() + [done(0)], 0, "reported twice"),
    (["not json"] + one_test() + [done(0)], 0, "malformed"),
    (one_test() + [done(3)], 3, "did not finish"),
])
def test_judge_believes_only_complete_consistent_reports(judge, lines, exit_code, why):
    result, problem = judge["reduce"](lines, exit_code)
    if why is None:
        assert problem is None and result["outcomes"] == {"t::a": "passed" if exit_code == 0 else "failed"}
    else:
        assert result is None and why in problem


def test_result_without_the_judges_mac_is_forged():
    key = new_key()
    body = json.dumps({"ok": True, "problem": None, "exit_code": 0, "outcomes": {"t::a": "passed"}, "failures": {},
                       "locations": {}, "collect_errors": [], "denied": []}).encode()
    for data in (body, b"0" * 64 + b"\n" + body, b""):
        r = SuiteResult.read(data, key, exit_code=0, duration_s=0.0)
        assert not r.ok and r.forged and not r.outcomes


def test_key_never_travels_in_argv_or_environment():
    key = new_key()
    argv = driver_argv(DEMO, python="py", runtime="/rt", repo="/w", out="/w/o.json")
    assert key.hex() not in " ".join(argv) and key.hex() not in json.dumps(TEST_ENV)
    assert key_line(key) == key.hex().encode() + b"\n"


def test_library_that_forges_the_result_and_exits_early_gets_no_pass():
    """The old attack shape against the new runner: write a passing result, then leave."""
    forged = ("import os, json\n"
              "for p in ('/proc/%d/cmdline' % os.getppid(),):\n"
              "    args = open(p, 'rb').read().split(b'\\0')\n"
              "    out = args[args.index(b'--out') + 1].decode() if b'--out' in args else None\n"
              "if out:\n"
              "    open(out, 'w').write(json.dumps({'ok': True, 'outcomes': {'tests/test_demo.py::test_add': 'passed'}}))\n"
              "os._exit(0)\n")
    r = local_run(demo_tree(forged))  # reading the judge's argv from /proc is refused by the audit hook
    assert r.outcomes.get("tests/test_demo.py::test_add") != "passed" and r.denied
    blind = "import os\nopen('result.json', 'w').write('{\"ok\": true}')\nos._exit(0)\n"
    r = local_run(demo_tree(blind))
    assert not r.ok and not r.outcomes and "stopped before the end" in (r.problem or "")


@pytest.mark.parametrize("attempt", ["gc.get_objects()", "sys._getframe(0)", "inspect.currentframe().f_back",
                                     "__import__('_pytest.python')", "import_module('pytest')",
                                     "__import__('_pytest.python', {'__name__': '_pytest.runner'})",
                                     "sys.settrace(None)", "open(1, 'w', closefd=False)",
                                     "open('/proc/self/fd/1', 'w')",
                                     "try:\n        1 / 0\n    except ZeroDivisionError as e:\n        e.__traceback__.tb_frame"])
def test_audit_hook_refuses_library_introspection(attempt):
    src = f"import gc, sys, inspect\nfrom importlib import import_module\n\ndef add(a, b):\n    {attempt}\n    return a + b\n"
    r = local_run(demo_tree(src))
    assert r.ok and r.outcomes["tests/test_demo.py::test_add"] == "failed" and r.denied, (r.outcomes, r.denied)


def test_tests_themselves_may_introspect():
    """The guard is about library frames: a test using gc / frames is not refused."""
    r = local_run(demo_tree("def add(a, b):\n    return a + b\n", {
        "tests/test_intro.py": "import gc, sys\n\ndef test_intro():\n    gc.collect()\n    assert sys._getframe(0)\n"}))
    assert r.ok and not r.denied and set(r.outcomes.values()) == {"passed"}


@pytest.mark.slow
def test_judge_is_out_of_reach_inside_the_sandbox(backend):
    """From the tested code (same uid): the judge's memory, fds and environment cannot be opened,
    and a file planted at the result path is replaced, not believed."""
    probe = ("import os\n\n\ndef test_judge_unreachable():\n    ppid = os.getppid()\n"
             "    for name in ('mem', 'environ', 'fd/0', 'fd/1'):\n"
             "        try:\n            open('/proc/%d/%s' % (ppid, name), 'rb').read(1)\n"
             "        except (PermissionError, OSError):\n            continue\n"
             "        raise AssertionError('judge reachable through ' + name)\n")
    r = G.run_in_sandbox(backend, DEMO, demo_tree("def add(a, b):\n    return a + b\n",
                                                  {"tests/test_probe.py": probe}), timeout_s=60)
    assert r.ok and r.outcomes["tests/test_probe.py::test_judge_unreachable"] == "passed", r.output_tail


@pytest.mark.slow
def test_library_that_never_returns_or_floods_gets_no_pass(backend):
    limits = G.GRADE_LIMITS
    for src in ("def add(a, b):\n    while True:\n        pass\n",
                "import sys\n\ndef add(a, b):\n    print('x' * (1 << 20) * 50)\n    return a - b\n"):
        r = G.run_in_sandbox(backend, DEMO, demo_tree(src), limits=limits, timeout_s=8)
        assert r.outcomes.get("tests/test_demo.py::test_add") != "passed"


def test_canaries_catch_a_run_where_everything_passes():
    tree = {"t/test_a.py": b"def test_x():\n    assert f()\n"}
    c = G.add_canaries(tree, ["t/test_a.py::test_x"], rng=random.Random(1))
    assert len(c.node_ids) == G.N_CANARIES and all(n.startswith("t/test_a.py::test_") for n in c.node_ids)
    compile(tree["t/test_a.py"], "t/test_a.py", "exec")
    honest = SuiteResult(ok=True, outcomes={"t/test_a.py::test_x": "passed", **{n: "failed" for n in c.node_ids}})
    forged = SuiteResult(ok=True, outcomes={"t/test_a.py::test_x": "passed", **{n: "passed" for n in c.node_ids}})
    dropped = SuiteResult(ok=True, outcomes={"t/test_a.py::test_x": "passed"})
    assert G.canaries_passed(honest, c) == 0
    assert G.canaries_passed(forged, c) == G.N_CANARIES and G.canaries_passed(dropped, c) == G.N_CANARIES
    v = G.verdict(forged, ["t/test_a.py::test_x"], [], canaries=c)
    assert not v.resolved and v.tampered and v.checks()["canary_passed"] == G.N_CANARIES


def test_canaries_really_fail_under_the_runner():
    tree = demo_tree("def add(a, b):\n    return a + b\n")
    c = G.add_canaries(tree, ["tests/test_demo.py::test_add"])
    r = local_run(tree)
    assert r.ok and all(r.outcomes[n] == "failed" for n in c.node_ids)
    assert r.outcomes["tests/test_demo.py::test_add"] == "passed"


def test_plain_pytest_is_fooled_by_the_generic_patch():
    """The attack is real: without the defences the no-op patch makes a failing suite pass."""
    tree = demo_tree(BUGGY + NOOP_PYTEST)
    with tempfile.TemporaryDirectory() as td:
        for rel, data in tree.items():
            (Path(td) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(td) / rel).write_bytes(data)
        rt = L.ensure_runtime()
        p = subprocess.run([str(L.interpreter()), "-B", "-s", "-S", "-c",
                            f"import sys; sys.path.insert(0, {str(rt / 'site')!r}); import pytest; "
                            f"sys.path.insert(0, {td!r}); sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
                            f"'--rootdir', {td!r}, {td + '/tests'!r}]))"],
                           cwd=td, env=TEST_ENV, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        honest = local_run(tree)
    assert honest.outcomes["tests/test_demo.py::test_add"] == "passed"  # the patch no-ops it in-process ...
    r = E.check_edits(DEMO, {"demo/__init__.py": BUGGY.encode()}, {"demo/__init__.py": (BUGGY + NOOP_PYTEST).encode()})
    assert "module_level" in r.rules()  # ... which is why grading validates the edit first
