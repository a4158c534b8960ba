"""Running a library's test suite the same way at build time, in the agent's sandbox and at grading.

Two processes per run, so that the outcome is decided where library code never runs:

* the **judge** (`driver.py`, `JUDGE_SOURCE` below): standard library only; it never imports
  pytest nor anything from the repository. It reads a per-run key from stdin (only when it must
  write a result), makes itself non-dumpable (a same-uid process cannot read its memory or open
  its fds through /proc), starts the worker on a pipe, turns the worker's per-test reports into
  outcomes, checks that the report stream is complete and agrees with the worker's real exit
  status, and writes the result file, authenticated with HMAC-SHA256 under the key.
* the **worker** (`worker.py`, `WORKER_SOURCE`): imports pytest from the runtime *before* the
  repository is on sys.path (a `pytest.py` or `_pytest/` in the repository cannot stand in for
  it), installs its guards, runs the suite with a plugin that streams each test's reports,
  failure text, last traceback frames and location as JSON lines on an inherited pipe, and
  holds no key.

    python -B -s -S -P driver.py --worker <runtime>/worker.py --site <runtime>/site
        --import-root <repo[/src]> --rootdir <repo> [--out F] ...

* `-S`: no `site` import, so no `.pth` file and no `sitecustomize` / `usercustomize` runs;
  `-s`: no user site; `-P`: the script's directory is not put on sys.path; `-B`: no bytecode.
  (`-I` would also drop PYTHON* variables such as PYTHONHASHSEED, which we set on purpose; the
  environment is passed explicitly instead, so the agent cannot add to it.)
* pytest gets `-p no:cacheprovider --noconftest -c /dev/null --rootdir <repo>`: no cache
  directory, no `conftest.py` anywhere has an effect, and no `pytest.ini` / `setup.cfg` /
  `tox.ini` / `pyproject.toml` configures the run.

What the split buys: library code can no longer write, wrap or forge the result (the writer and
the key live in the judge), nor end the run early with a result of its choosing (a worker that
dies, exits with a status its reports contradict, or stops mid-test yields no pass). What it does
not buy: the worker runs the tests and the library in one interpreter, so code that reaches
pytest's objects from inside could still make pytest *report* a pass. That is closed before the
suite runs, by validating the agent's edit and running only its function bodies spliced into the
starting files (editcheck.py: no import-time code of the agent's, an allow-list on what new code
references, no route from a string to code); refused while it runs, by the worker's audit hook
(frames, heap walks, tracing, processes, raw fds from library code; annotation strings that are
not type expressions; code strings and raw-fd opens that C code such as pickle runs for data;
unpickling of process modules) and import guard (library functions may not import pytest,
pluggy, the worker or the process modules by name); and detected afterwards by canary tests
that must fail (grader.py). The worker reports every refusal; the judge passes them on as
`denied`. Code that gets full control of the worker anyway is outside what these in-process
refusals can stop; at grading the verdict does not rest on them: the tests are rewritten to
report canonical values (`Observer`, one `obs` record per test, which the judge takes only once,
inside its test, as bounded strings) and the host compares those with the pristine library's
(observe.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import resource
import secrets
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

# pytest's exit codes after which the reports describe the whole selection: 0 all passed, 1 some
# failed, 2 collection errors, 5 nothing collected. Anything else (3 internal error, 4 usage, a
# signal) is a run that did not finish.
FINISHED_EXIT_CODES = (0, 1, 2, 5)

JUDGE_SOURCE = r'''"""jointrl swe-v0 test judge: runs worker.py, decides outcomes, writes the result (see envs/swe/runner.py).

Standard library only; it never imports pytest or the repository under test."""
import argparse
import ctypes
import hashlib
import hmac
import json
import os
import select
import subprocess
import sys

MAX_EVENT_BYTES = 64 << 20
PR_SET_DUMPABLE = 4
# An observation record (envs/swe/observe.py) is a list of short strings: the worker's canonical
# values, never anything the judge or the host would have to interpret.
OBS_MAX_ITEMS = 4001
OBS_MAX_CHARS = 200
FINISHED = (0, 1, 2, 5)


def read_key():
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < 256:
        chunk = os.read(0, 256 - len(buf))
        if not chunk:
            break
        buf += chunk
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    key = bytes.fromhex(buf.decode("ascii", "replace").strip())
    if len(key) < 16:
        raise SystemExit("judge: --out needs a key of >= 16 bytes on stdin")
    return key


def collect(proc, r):
    """All event bytes the worker wrote, until it exits (children it left behind cannot hold us)."""
    data = bytearray()
    over = False
    while True:
        exited = proc.poll() is not None
        ready, _, _ = select.select([r], [], [], 0 if exited else 0.5)
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            if len(data) + len(chunk) > MAX_EVENT_BYTES:
                over = True
                proc.kill()
            else:
                data += chunk
        elif exited:
            break
    return bytes(data), over


def reduce(lines, worker_exit):
    """Outcomes from the report stream, or (None, why) when the stream cannot be believed."""
    try:
        return _reduce(lines, worker_exit)
    except (KeyError, TypeError, ValueError, AttributeError):  # a report with missing or mistyped fields
        return None, "malformed report line"


def _reduce(lines, worker_exit):
    outcomes, failures, locations, collect_errors, denied, observations = {}, {}, {}, [], [], {}
    opened, closed = set(), set()
    done = None
    for raw in lines:
        if not raw.strip():
            continue
        try:
            ev = json.loads(raw)
            kind = ev["k"]
        except Exception:
            return None, "malformed report line"
        if done is not None:
            return None, "reports after the end of the run"
        if kind == "loc":
            locations[str(ev["nid"])] = [str(ev["path"]), int(ev["line"])]
        elif kind == "collect_error":
            collect_errors.append({"nodeid": str(ev["nid"]), "message": str(ev["message"])[-3000:]})
        elif kind == "fail":
            nid = str(ev["nid"])
            if nid not in failures:
                failures[nid] = {"when": str(ev["when"]), "message": str(ev["message"])[:2000],
                                 "frames": [[str(p), int(n), str(f)] for p, n, f in ev["frames"]][-4:]}
        elif kind == "rep":
            nid, when, outcome = str(ev["nid"]), str(ev["when"]), str(ev["outcome"])
            if when not in ("setup", "call", "teardown") or outcome not in ("passed", "failed", "skipped"):
                return None, "unknown report"
            if when == "setup":
                if nid in opened:
                    return None, "test reported twice"
                opened.add(nid)
            elif nid not in opened or nid in closed:
                return None, "report outside a test's setup/teardown"
            if when == "teardown":
                closed.add(nid)
            if when == "call":
                if ev.get("xfail"):
                    outcome = "xfailed" if outcome == "skipped" else "xpassed"
                if outcomes.get(nid) != "error":
                    outcomes[nid] = outcome
            elif outcome == "failed":
                outcomes[nid] = "error"
            elif outcome == "skipped" and when == "setup":
                outcomes[nid] = "skipped"
        elif kind == "obs":
            # one record per test, inside its own setup..teardown, of bounded strings only
            nid, values, end = ev["nid"], ev["v"], ev["end"]
            if type(nid) is not str or nid not in opened or nid in closed or nid in observations:
                return None, "an observation outside its test, or twice"
            if type(values) is not list or len(values) > OBS_MAX_ITEMS or type(end) is not str \
                    or len(end) > OBS_MAX_CHARS \
                    or any(type(x) is not str or len(x) > OBS_MAX_CHARS for x in values):
                return None, "a malformed observation"
            observations[nid] = [values, end]
        elif kind == "denied":
            denied.append("%s at %s" % (str(ev["event"])[:100], str(ev["where"])[:300]))
        elif kind == "done":
            done = int(ev["exit"])
        else:
            return None, "unknown report kind"
    if done is None:
        return None, "the worker stopped before the end of the run (exit %s)" % worker_exit
    if done != worker_exit:
        return None, "the worker reported exit %d but exited with %s" % (done, worker_exit)
    if worker_exit not in FINISHED:
        return None, "the run did not finish (exit %s)" % worker_exit
    if opened != closed:
        return None, "a test started but never finished"
    bad = [v for v in outcomes.values() if v in ("failed", "error")] or collect_errors
    if bad and worker_exit == 0:
        return None, "exit 0 with failing tests"
    if not bad and worker_exit in (1, 2):
        return None, "exit %d with no failing test" % worker_exit
    for nid in opened:  # a test whose setup passed but that has no call report did not pass
        outcomes.setdefault(nid, "error")
    return {"exit_code": worker_exit, "outcomes": outcomes, "failures": failures, "locations": locations,
            "collect_errors": collect_errors, "denied": denied[:100], "observations": observations}, None


def write_result(path, key, body):
    data = body.encode()
    mac = hmac.new(key, data, hashlib.sha256).hexdigest().encode()
    try:
        os.unlink(path)  # whatever the worker may have put there (a file, a symlink)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(mac + b"\n" + data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--site", required=True)
    ap.add_argument("--import-root", required=True)
    ap.add_argument("--rootdir", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--library-dir", action="append", default=[])
    ap.add_argument("--deselect", action="append", default=[])
    ap.add_argument("selectors", nargs="*")
    a = ap.parse_args()
    # Before anything secret is in memory: no same-uid process may read it or our fds via /proc.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    key = read_key() if a.out else None
    r, w = os.pipe()
    argv = [sys.executable, "-B", "-s", "-S", "-P", a.worker, "--site", a.site, "--import-root", a.import_root,
            "--rootdir", a.rootdir, "--events-fd", str(w)]
    for d in a.library_dir:
        argv += ["--library-dir", d]
    for d in a.deselect:
        argv += ["--deselect", d]
    proc = subprocess.Popen(argv + ["--"] + a.selectors, stdin=subprocess.DEVNULL, pass_fds=(w,))
    os.close(w)
    data, over = collect(proc, r)
    os.close(r)
    code = proc.wait()
    if over:
        result, why = None, "more than %d bytes of reports" % MAX_EVENT_BYTES
    else:
        result, why = reduce(data.decode("utf-8", "replace").split("\n"), code)
    if key is not None:
        body = {"ok": result is not None, "problem": why, **(result or {"exit_code": code})}
        write_result(a.out, key, json.dumps(body))
    return code if 0 <= code < 256 else 1


if __name__ == "__main__":
    sys.exit(main())
'''

WORKER_SOURCE = r'''"""jointrl swe-v0 test worker: pytest with a plugin streaming reports to the judge (see envs/swe/runner.py).

It holds no key and writes no result: the judge decides from these reports and our exit status."""
import argparse
import collections
import collections.abc as abc
import hashlib
import inspect
import json
import operator
import os
import random
import sys
import types


# Audit events that library code has no business raising: frames, tracing, heap walks, code
# objects, processes, raw fds. Denied (the call raises) when the first frame outside the standard
# library that raised it is library code; reported to the judge either way.
DENY_FIRST_OUTSIDE_STDLIB = frozenset({
    "sys._current_frames", "sys.settrace", "sys.setprofile", "sys.addaudithook", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.cdata", "ctypes.call_function", "ctypes.addressof", "ctypes.string_at", "builtins.input",
    "socket.__new__",
})
# Raised by the stdlib on a library's behalf (namedtuple, enum, dataclasses at import; the import
# system unmarshals bytecode when a library imports a module lazily): denied only when library
# code itself is the immediate caller.
DENY_IMMEDIATE = frozenset({"sys._getframe", "exec", "compile", "object.__getattr__", "object.__setattr__",
                            "marshal.loads", "code.__new__", "function.__new__"})
# Modules library code may not import by name (`__import__`, `importlib.import_module`, or a
# library helper that imports what it is told, such as toolz's pickling support): the test
# framework and this worker.
PROTECTED_MODULES = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "__main__", "py"})
# Modules that reach the process or the interpreter: library *functions* may not import them by
# name at run time (a library helper handed a string built at run time, such as toolz's
# `_restore_curry` reached through a `__reduce__`, would import and walk whatever it is told).
# Module-level library code is the starting file's (editcheck.splice) and may import anything.
# `builtins` is not among them (toolz pickles `curry(map)` by importing its module): its members
# that run code are refused where they run (string compiles, unpickling, raw-fd opens).
PROCESS_MODULES = frozenset({
    "os", "posix", "sys", "gc", "ctypes", "_ctypes", "subprocess", "_posixsubprocess", "signal",
    "_signal", "socket", "_socket", "mmap", "fcntl", "pty", "resource", "faulthandler", "marshal", "pickle",
    "_pickle", "copyreg", "multiprocessing", "threading", "_thread", "atexit", "tracemalloc", "code", "codeop",
    "runpy", "pdb", "bdb", "traceback", "site", "sysconfig", "zipimport", "_imp", "_frozen_importlib",
    "_frozen_importlib_external", "importlib", "io", "_io", "shutil", "tempfile", "pathlib", "glob", "select",
    "selectors", "asyncio", "posixpath", "shlex", "_posixshmem", "_osx_support", "sitecustomize",
})
# Lazy imports the pinned libraries' own functions make (toolz's `__version__`).
PROCESS_MODULES_ALLOWED = frozenset({"importlib.metadata"})
# Unpickling may not resolve these (a `__reduce__` can name any global; the tests unpickle
# what library code pickled): modules that reach the process, the interpreter or run strings as
# code, and builtins that run or look up code. (multiprocessing and threading are left alone: a
# process pool unpickles its own helpers.)
UNPICKLE_DENIED_MODULES = frozenset({
    "os", "posix", "sys", "gc", "ctypes", "_ctypes", "subprocess", "_posixsubprocess", "signal", "_signal",
    "socket", "_socket", "pty", "shutil", "importlib", "runpy", "code", "codeop", "pdb", "bdb", "pickle",
    "_pickle", "marshal", "io", "_io", "atexit", "faulthandler", "tracemalloc", "resource", "mmap", "fcntl",
    "select", "selectors", "tempfile", "pathlib", "glob", "site", "sysconfig", "zipimport", "doctest", "timeit",
    "cProfile", "profile", "trace", "inspect", "posixpath", "_imp", "_frozen_importlib",
    "_frozen_importlib_external",
})
UNPICKLE_DENIED_BUILTINS = frozenset({"eval", "exec", "compile", "__import__", "open", "breakpoint", "input",
                                      "globals", "vars", "locals"})
# Annotation evaluators (typing.get_type_hints, inspect.get_annotations(eval_str=True)) compile
# strings that library code may have produced; such a string must be a type expression.
ANNOTATION_EVALUATORS = ("typing.py", "inspect.py", "annotationlib.py")
# What a frame's code must name for a string compile or a raw-fd open made on its behalf to be
# its own: a test that calls `exec` or `open` names it; a test frame that only called
# `pickle.loads` or `map` did not ask for the `exec` / `open` those ran for library data.
ASKED_BY_NAME = {"compile": frozenset({"exec", "eval", "compile"}), "open": frozenset({"open", "fdopen", "FileIO"})}
TYPE_EXPRESSION_NODES = ("Expression", "Name", "Attribute", "Subscript", "Constant", "Tuple", "List", "BinOp",
                         "BitOr", "Load", "Slice")
FRAME_ATTRS = frozenset({"f_code", "tb_frame", "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code",
                         "__code__", "f_back", "f_globals", "f_locals"})
FRAME_HELPERS = frozenset({"currentframe", "stack", "getouterframes", "trace", "getframeinfo", "extract_stack",
                           "walk_stack", "format_stack", "print_stack"})


def guard(emit, library_dirs, stdlib, runtime):
    """Install the audit hook (it cannot be removed once added)."""
    import _thread

    import ast

    getframe = sys._getframe
    watched = DENY_FIRST_OUTSIDE_STDLIB | DENY_IMMEDIATE | {"open", "pickle.find_class"}
    state = _thread._local()  # per thread: reading f_code below raises an audit event of its own

    def is_library(f):
        fn = f.f_code.co_filename
        if not any(fn.startswith(d) for d in library_dirs):
            return False
        name = os.path.basename(fn)
        return not (name.startswith("test_") or name == "conftest.py" or "/tests/" in fn or "/test/" in fn)

    def is_library_file(fn):
        return isinstance(fn, str) and any(fn.startswith(d) for d in library_dirs)

    def is_stdlib(f):
        fn = f.f_code.co_filename
        return fn.startswith(stdlib) or fn.startswith("<frozen")

    def hook(event, args, watched=watched, frame_attrs=FRAME_ATTRS):
        # Called for every audit event of the run (cachetools' suite alone raises 130,000
        # `builtins.id`): the first test must stay one local set lookup.
        if event not in watched:
            return
        if event[:7] == "object." and (len(args) < 2 or args[1] not in frame_attrs):
            return
        if event == "open" and not (args and (isinstance(args[0], int) or (
                isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).startswith(("/proc", "/dev/fd"))))):
            return
        if getattr(state, "busy", False):
            return
        state.busy = True
        try:
            check(event, args, getframe(1))  # the caller of the audited function
        finally:
            state.busy = False

    def not_a_type_expression(source):
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError):
            return False  # compile itself refuses it
        return any(type(n).__name__ not in TYPE_EXPRESSION_NODES or (
            type(n).__name__ == "Attribute" and n.attr.startswith("_")) for n in ast.walk(tree))

    def refuse(event, where):
        emit(k="denied", event=event, where=where)
        raise RuntimeError("jointrl: %s is not allowed (%s)" % (event, where))

    def check(event, args, f):
        if event == "pickle.find_class":
            module, name = str(args[0]), str(args[1])
            parts = name.split(".")
            if module == "builtins":
                bad = name in UNPICKLE_DENIED_BUILTINS
            else:
                bad = module.partition(".")[0] in UNPICKLE_DENIED_MODULES | PROTECTED_MODULES
            if bad or any(p in UNPICKLE_DENIED_MODULES or p.startswith("__") for p in parts):
                refuse("unpickling %s.%s" % (module[:100], name[:100]), "pickle")
            return
        if event == "compile" and f is not None and args and isinstance(args[0], (str, bytes)) \
                and is_stdlib(f) and os.path.basename(f.f_code.co_filename) in ANNOTATION_EVALUATORS:
            source = args[0].decode("utf-8", "replace") if isinstance(args[0], bytes) else args[0]
            if not_a_type_expression(source):
                refuse("evaluating the annotation %r" % source[:100], "%s:%d" % (f.f_code.co_filename, f.f_lineno))
            return
        deny = False
        if event in DENY_IMMEDIATE:
            g = f
            if event == "sys._getframe" and f is not None and f.f_code.co_name in FRAME_HELPERS and is_stdlib(f):
                g = f.f_back  # inspect.currentframe() and friends, called by the library
            deny = g is not None and is_library(g)
        else:
            g = f
            while g is not None and is_stdlib(g):
                g = g.f_back
            deny = g is not None and is_library(g)
        # only when nothing of the standard library stands between: C code (pickle, map) called it
        if not deny and event in ASKED_BY_NAME and g is not None and g is f and not is_stdlib(g) \
                and not g.f_code.co_filename.startswith(runtime) \
                and (event == "open" or isinstance(args[0], (str, bytes))) \
                and not ASKED_BY_NAME[event].intersection(g.f_code.co_names):
            refuse(event + " run for data (the calling code never names it)",
                   "%s:%d" % (g.f_code.co_filename, g.f_lineno))
        if deny:
            where = "%s:%d" % (g.f_code.co_filename, g.f_lineno)
            emit(k="denied", event=event, where=where)
            raise RuntimeError("jointrl: %s from library code is not allowed (%s)" % (event, where))

    sys.addaudithook(hook)

    import builtins
    import importlib

    real_import, real_import_module = builtins.__import__, importlib.import_module
    modules = sys.modules

    def refuse_import(name, process=False):
        f = getframe(2)  # the frame that asked for the import
        while f is not None and is_stdlib(f):
            f = f.f_back
        if f is not None and is_library(f) and not (process and f.f_code.co_name == "<module>"):
            where = "%s:%d" % (f.f_code.co_filename, f.f_lineno)
            emit(k="denied", event="import " + name[:100], where=where)
            raise ImportError("jointrl: library code may not import %s (%s)" % (name, where))

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and isinstance(name, str) and name.partition(".")[0] in PROCESS_MODULES \
                and name not in PROCESS_MODULES_ALLOWED and type(globals) is dict \
                and is_library_file(globals.get("__file__")):
            refuse_import(name, process=True)
        if level == 0 and isinstance(name, str) and name.partition(".")[0] in PROTECTED_MODULES:
            # pytest imports its own modules inside functions (~12,000 times per suite): an
            # `import` statement names its module's globals, so those need no frame walk.
            importer = globals.get("__name__") if type(globals) is dict else None
            module = modules.get(importer) if isinstance(importer, str) else None
            if not (module is not None and importer.partition(".")[0] in PROTECTED_MODULES
                    and getattr(module, "__dict__", None) is globals):  # a real module's, not a made-up dict
                refuse_import(name)
        return real_import(name, globals, locals, fromlist, level)

    def guarded_import_module(name, package=None):
        if isinstance(name, str) and name.partition(".")[0] in PROTECTED_MODULES:
            refuse_import(name)
        if isinstance(name, str) and name.partition(".")[0] in PROCESS_MODULES and name not in PROCESS_MODULES_ALLOWED:
            refuse_import(name, process=True)
        return real_import_module(name, package)

    builtins.__import__ = guarded_import
    importlib.import_module = guarded_import_module


# The observation channel (envs/swe/observe.py): the transformed tests call `_jointrl_observe`
# where they asserted; each operand becomes a canonical string of plain data. Objects are never
# asked for their `repr` or `__eq__`: builtin scalars and containers by content, collections by
# iteration, anything else by its type's name. Strings longer than OBS_MAX_CHARS are sent as
# their SHA-256, and a test's list past OBS_MAX_ITEMS is folded into one digest.
OBS_MAX_CHARS = 160
OBS_MAX_ITEMS = 4000
OBS_MAX_ELEMENTS = 1000
OBS_MAX_DEPTH = 12


def _qualname(t):
    return "%s.%s" % (getattr(t, "__module__", "?"), getattr(t, "__qualname__", "?"))


def canon(v, depth=0):
    """A JSON-able description of `v` that holds only builtin data."""
    t = type(v)
    if depth > OBS_MAX_DEPTH:
        return {"deep": _qualname(t)}
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return v if v.bit_length() < 53 else {"i": hex(v)}
    if t is float or t is complex:
        return {"f": repr(v)}
    if t is bytes or t is bytearray:
        return {"b": bytes(v[:OBS_MAX_ELEMENTS * 4]).hex(), "n": len(v)}
    if t is list or t is tuple or t is collections.deque:
        return {t.__name__[0]: [canon(x, depth + 1) for x in list(v)[:OBS_MAX_ELEMENTS]], "n": len(v)}
    if t is dict or t is collections.defaultdict or t is collections.Counter or t is collections.OrderedDict:
        items = [[canon(k, depth + 1), canon(x, depth + 1)] for k, x in list(dict.items(v))[:OBS_MAX_ELEMENTS]]
        if t is not collections.OrderedDict:
            items.sort(key=lambda kv: json.dumps(kv[0], sort_keys=True))
        return {"d": items, "t": t.__name__, "n": len(v)}
    if t is set or t is frozenset:
        return {"s": sorted(json.dumps(canon(x, depth + 1), sort_keys=True) for x in list(v)[:OBS_MAX_ELEMENTS]),
                "n": len(v)}
    if t is range or t is slice:
        return {"r": [canon(v.start), canon(v.stop), canon(v.step)]}
    if isinstance(v, BaseException):
        return {"e": _qualname(t), "a": canon(v.args, depth + 1) if type(v.args) is tuple else None}
    if isinstance(v, type):
        return {"T": _qualname(v)}
    if t in (types.FunctionType, types.BuiltinFunctionType, types.MethodType):
        return {"F": getattr(v, "__qualname__", "?")}
    out = {"o": _qualname(t)}
    try:  # a collection's content by iteration (never an iterator: that would consume it), as
        # the test's own `==` or `in` would have read it
        if isinstance(v, abc.Mapping):
            keys = [k for k, _ in zip(iter(v), range(OBS_MAX_ELEMENTS))]
            out["items"] = [[canon(k, depth + 1), canon(v[k], depth + 1)] for k in keys]
        elif isinstance(v, abc.Collection) and not isinstance(v, abc.Iterator):
            out["items"] = [canon(k, depth + 1) for k, _ in zip(iter(v), range(OBS_MAX_ELEMENTS))]
    except Exception as e:
        out["err"] = _qualname(type(e))
    return out


class Observer:
    """Collects one test's observations (from its setup to the end of its call)."""

    def __init__(self):
        self.values = None
        self.digest = None

    def start(self):
        self.values, self.digest = [], None

    def add(self, item):
        if self.values is None:
            return
        s = json.dumps(item, sort_keys=True)
        if len(s) > OBS_MAX_CHARS:
            s = "#" + hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()
        if len(self.values) < OBS_MAX_ITEMS:
            self.values.append(s)
        else:
            self.digest = hashlib.sha256(((self.digest or "") + s).encode("utf-8", "surrogatepass")).hexdigest()

    def take(self):
        vals = self.values if self.values is not None else []
        if self.digest is not None:
            vals = vals + ["#folded:" + self.digest]
        self.values, self.digest = None, None
        return vals

    def __call__(self, kind, how, mask, *values):
        """`_jointrl_observe(kind, how, mask, *operands)`, what a transformed assertion became."""
        try:
            item = [kind, [canon(v) for v in values]]
        except Exception as e:
            item = [kind, "canon-raised", _qualname(type(e))]
        self.add(item)
        if "s" not in mask:  # nothing dropped: the assertion's own verdict too, as an entry of its own
            self.add(["=", self.evaluate(kind, how, values)])  # (kept when the values are masked)

    @staticmethod
    def evaluate(kind, how, values):
        ops = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
               ">=": operator.ge, "is": operator.is_, "is not": operator.is_not,
               "in": lambda a, b: a in b, "not in": lambda a, b: a not in b}
        try:
            if kind == "cmp":
                return all(bool(ops[op](values[i], values[i + 1])) for i, op in enumerate(how.split(",")))
            if kind == "not":
                return not values[0]
            if kind == "truth":
                return bool(values[0])
            how(*values)  # a unittest assertion, bound to its test case
            return True
        except AssertionError:
            return False
        except Exception as e:
            return "raised " + _qualname(type(e))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", required=True)
    ap.add_argument("--import-root", required=True)
    ap.add_argument("--rootdir", required=True)
    ap.add_argument("--events-fd", type=int, required=True)
    ap.add_argument("--library-dir", action="append", default=[])
    ap.add_argument("--deselect", action="append", default=[])
    ap.add_argument("selectors", nargs="*")
    a = ap.parse_args()
    sys.path.insert(0, a.site)
    import pytest  # from the runtime, before the repository is importable

    sys.path.insert(0, a.import_root)
    root = os.path.realpath(a.rootdir)
    fd = a.events_fd
    os.set_inheritable(fd, False)  # subprocesses the tests start do not get it
    dumps, write = json.dumps, os.write

    def emit(**ev):
        data = (dumps(ev) + "\n").encode()
        while data:
            data = data[write(fd, data):]

    guard(emit, [os.path.realpath(d) + os.sep for d in a.library_dir], os.path.dirname(os.__file__) + os.sep,
          os.path.dirname(os.path.realpath(a.site)) + os.sep)

    def rel(p):
        p = os.path.realpath(str(p))
        return os.path.relpath(p, root) if p.startswith(root + os.sep) else "<outside>/" + os.path.basename(p)

    import builtins

    observer = Observer()
    builtins._jointrl_observe = observer
    ends = {}  # test -> how its call ended, until its record is sent

    class Reporter:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(self, item):
            observer.start()
            ends.pop(item.nodeid, None)
            random.seed(0)  # each test from the same state (cachetools' RRCache evicts at random)

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_teardown(self, item):
            # one record per test, before its teardown report closes it (subtests make several
            # call reports; the first failure among them is how the call ended)
            if item.nodeid in ends:
                emit(k="obs", nid=item.nodeid, v=observer.take(), end=ends.pop(item.nodeid))
            else:
                observer.take()

        def pytest_collection_modifyitems(self, items):
            for it in items:
                fn = getattr(it, "obj", None)
                try:
                    fn = inspect.unwrap(getattr(fn, "__func__", fn))
                    code = fn.__code__
                    emit(k="loc", nid=it.nodeid, path=rel(code.co_filename), line=code.co_firstlineno)
                except Exception:
                    pass

        def pytest_collectreport(self, report):
            if report.failed:
                emit(k="collect_error", nid=report.nodeid, message=str(report.longrepr)[-3000:])

        def pytest_runtest_makereport(self, item, call):
            if call.when == "call" and ends.get(item.nodeid, "ok") == "ok":
                ends[item.nodeid] = "ok" if call.excinfo is None else (
                    "raised " + _qualname(call.excinfo.type))[:OBS_MAX_CHARS]
            if call.excinfo is not None and call.when in ("setup", "call"):
                ei = call.excinfo
                frames = [[rel(e.path), e.lineno + 1, e.name] for e in list(ei.traceback)[-4:]]
                emit(k="fail", nid=item.nodeid, when=call.when, message=ei.exconly()[:2000], frames=frames)
            return None

        def pytest_runtest_logreport(self, report):
            emit(k="rep", nid=report.nodeid, when=report.when, outcome=report.outcome,
                 xfail=hasattr(report, "wasxfail"))

    args = list(a.selectors) + ["-p", "no:cacheprovider", "--noconftest", "-c", "/dev/null", "--rootdir", root,
                                "-q", "--tb=short", "-rfE", "-W", "ignore"]
    for d in a.deselect:
        args += ["--deselect", d]
    code = int(pytest.main(args, plugins=[Reporter()]))
    emit(k="done", exit=code)
    return code


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


class ResultForged(ValueError):
    """The result file does not carry the judge's MAC under this run's key: something else wrote it."""


@dataclass(frozen=True)
class SuiteResult:
    """One suite run. `outcomes`: node id -> passed / failed / error / skipped / xfailed / xpassed.

    `ok` is False when no believable result came back: the judge wrote none (crash, kill,
    timeout), the judge rejected the worker's reports (`problem` says why), or the file was not
    the judge's (`forged`)."""

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
    problem: str | None = None  # why the judge did not believe the worker's reports
    forged: bool = False  # a result file was there, but not with the judge's MAC
    denied: tuple[str, ...] = ()  # audit events library code raised and the worker refused
    # test -> (canonical values, how its call ended): what the tested process reported, as data
    # to compare with the reference's (observe.py), never as a verdict
    observations: Mapping[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    def passed(self) -> frozenset[str]:
        return frozenset(k for k, v in self.outcomes.items() if v == "passed")

    def not_passed(self, ids: Sequence[str]) -> list[str]:
        return [i for i in ids if self.outcomes.get(i) != "passed"]

    @staticmethod
    def from_result(data: bytes, key: bytes, *, exit_code: int, duration_s: float, timed_out: bool = False,
                    output_tail: str = "") -> "SuiteResult":
        """Parse the judge's result file; `ResultForged` if its MAC is not the judge's under `key`."""
        mac, _, body = data.partition(b"\n")
        want = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(mac, want):
            raise ResultForged("the result file does not carry this run's MAC")
        d = json.loads(body)
        if not d.get("ok"):
            return SuiteResult(ok=False, exit_code=exit_code, timed_out=timed_out, duration_s=duration_s,
                               output_tail=output_tail, problem=str(d.get("problem") or "no result"))
        fails = {str(k): Failure(message=str(v["message"]), when=str(v["when"]),
                                 frames=tuple((str(p), int(n), str(f)) for p, n, f in v["frames"]))
                 for k, v in d["failures"].items()}
        locs = {str(k): (str(v[0]), int(v[1])) for k, v in d["locations"].items()}
        obs = {str(k): (tuple(str(x) for x in v[0]), str(v[1])) for k, v in d.get("observations", {}).items()}
        return SuiteResult(ok=True, outcomes={str(k): str(v) for k, v in d["outcomes"].items()}, failures=fails,
                           locations=locs, collect_errors=tuple(str(e["nodeid"]) for e in d["collect_errors"]),
                           denied=tuple(str(x) for x in d["denied"]), observations=obs, exit_code=exit_code, timed_out=timed_out, duration_s=duration_s, output_tail=output_tail)

    @staticmethod
    def read(data: bytes | None, key: bytes, *, exit_code: int, duration_s: float, timed_out: bool = False,
             output_tail: str = "") -> "SuiteResult":
        """`from_result`, with every way of not getting a believable result turned into `ok=False`."""
        common = dict(exit_code=exit_code, duration_s=duration_s, timed_out=timed_out, output_tail=output_tail)
        if data is None:
            return SuiteResult(ok=False, **common)
        try:
            return SuiteResult.from_result(data, key, **common)
        except ResultForged:
            return SuiteResult(ok=False, forged=True, problem="result file not written by the judge", **common)
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # MAC ok but unreadable: a judge bug
            raise RuntimeError(f"the judge wrote an unreadable result: {type(e).__name__}: {e}") from e


def new_key() -> bytes:
    """A fresh per-run key; it reaches the judge on stdin (`key_line`), never argv or the environment."""
    return secrets.token_bytes(32)


def key_line(key: bytes) -> bytes:
    return key.hex().encode() + b"\n"


def driver_argv(lib: Library, *, python: str, runtime: str, repo: str, out: str | None,
                selectors: Sequence[str] = (), deselect: Sequence[str] = ()) -> list[str]:
    """The argv of one suite run. Paths are as seen by the process (host paths or sandbox paths).
    With `out`, the judge reads the run's key from stdin (`key_line(key)`) before anything else."""
    import_root = repo if not lib.import_root else f"{repo}/{lib.import_root}"
    argv = [python, "-B", "-s", "-S", "-P", f"{runtime}/driver.py", "--worker", f"{runtime}/worker.py",
            "--site", f"{runtime}/site", "--import-root", import_root, "--rootdir", repo]
    for p in lib.packages:
        argv += ["--library-dir", f"{repo}/{p}"]
    if out is not None:
        argv += ["--out", out]
    for d in tuple(lib.deselect) + tuple(deselect):
        argv += ["--deselect", d]
    sels = list(selectors) or list(lib.test_dirs)
    for s in sels:
        if s.startswith("-"):
            raise ValueError(f"test selector {s!r} must be a path or node id, not an option")
    return argv + ["--"] + sels


# Address-space cap of every build-time suite run (judge, worker and the tests they run). A mutation can
# turn a loop into one that allocates without end; within its CPU-time allowance such a run reached 9 GB
# here and took the machine's memory from everything else. With the cap it fails with MemoryError instead,
# which disqualifies the mutation. The pristine suites of the pinned libraries run well inside it.
BUILD_ADDRESS_SPACE_BYTES = 4 << 30
# CPU-time backstop of the same runs: the caller's wall-clock timeout kills the driver, but a suite whose
# caller was itself killed (an interrupted build) would otherwise spin on forever as an orphan (seen: a
# mutant's endless loop still running 22 minutes after its build was stopped).
BUILD_CPU_SECONDS = 600
_PR_SET_PDEATHSIG = 1


def _cap_build_child() -> None:
    import ctypes
    import signal

    resource.setrlimit(resource.RLIMIT_AS, (BUILD_ADDRESS_SPACE_BYTES, BUILD_ADDRESS_SPACE_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (BUILD_CPU_SECONDS, BUILD_CPU_SECONDS))
    # die with the build process that started us (Linux prctl; the judge's own children are killed by the judge)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_suite_local(lib: Library, tree: Path, runtime: Path, python: Path, *, timeout_s: float = 120.0,
                    selectors: Sequence[str] = ()) -> SuiteResult:
    """Build-time run in a plain subprocess (our own trusted mutations, no agent code): the same
    judge, worker and flags as in the sandbox, so outcomes agree with grading."""
    with tempfile.TemporaryDirectory(prefix="swe-out-") as td:
        out = os.path.join(td, "result.json")
        key = new_key()
        argv = driver_argv(lib, python=str(python), runtime=str(runtime), repo=str(tree), out=out, selectors=selectors)
        t0 = time.monotonic()
        # CPU time, not wall time, decides "fast enough": on a shared machine wall time is noise.
        # RUSAGE_CHILDREN counts waited-for children (the judge, and the worker it waited for);
        # one suite runs at a time per process.
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # Its own session, killed as a group: on a timeout the judge is killed, and its worker (and anything
        # the tests started) must go with it, or an endless mutation keeps burning CPU up to its rlimit.
        proc = subprocess.Popen(argv, cwd=tree, env=TEST_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_cap_build_child, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(key_line(key), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            stdout, _ = proc.communicate()
            tail = (stdout or b"")[-2000:].decode("utf-8", "replace")
            return SuiteResult(ok=False, timed_out=True, duration_s=time.monotonic() - t0, output_tail=tail)
        finally:
            _kill_group(proc.pid)  # stragglers the tests left behind
        p = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        dt = time.monotonic() - t0
        tail = (p.stdout + p.stderr)[-3000:].decode("utf-8", "replace")
        data = Path(out).read_bytes() if os.path.isfile(out) and not os.path.islink(out) else None
        r = SuiteResult.read(data, key, exit_code=p.returncode, duration_s=dt, output_tail=tail)
        return dataclasses.replace(r, cpu_s=cpu)


def summarize(res: SuiteResult) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for v in res.outcomes.values():
        counts[v] = counts.get(v, 0) + 1
    return counts
