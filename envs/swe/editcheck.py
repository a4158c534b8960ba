"""Validating the agent's library edits before they are graded, and reducing them to function bodies.

The library runs in the same interpreter as pytest (runner.py), so an edit that reaches pytest,
the interpreter's hooks or the process itself could make failing tests report a pass. This
module decides, from the source alone, whether an edit stays within what a bug fix needs, and
builds the file that actually runs (`splice`):

* **No new files** in the package (a new module is new code that runs when something imports it;
  grader.py drops them before this check, which rejects any that reach it).
* **Only function bodies change, and only they are taken.** A file's import-time code (module and
  class bodies, decorators, annotations, base classes, metaclasses, class keywords, lambdas at
  module level, new functions, new imports: everything but the bodies of the functions and
  methods it already has) must be the starting file's, AST for AST; the one exception is a
  default value that is a plain constant and stays one (`flag=True` -> `flag=False`). Docstrings
  of modules and classes, comments and layout may differ but are not taken. The file that runs
  is then `splice(start, agent)`: the *starting* file's text with the agent's version of each
  changed function put in its place, checked to parse back to exactly the starting skeleton
  and the agent's functions. So no import-time code of the agent's ever runs, whatever this
  comparison might miss: annotations, decorators, defaults, class bodies, metaclasses,
  `__init_subclass__`, `__set_name__`, descriptors and module `__getattr__` are the starting file's.
* **No reach into the machinery** from a changed or new function: no imports beyond the
  allowlist, no references to the test machinery or the interpreter's internals (`pytest`,
  `_pytest`, `unittest`, `sys` beyond a few constants, `os` beyond `os.path`, `builtins`,
  `importlib`, `inspect` beyond signatures, `gc`, `atexit`, `json`, frames, tracing and audit
  hooks, `os._exit`, `eval` / `exec` / `compile` / `globals` / `open`), no dunder attribute
  outside the protocol methods (`__globals__`, `__code__`, `__subclasses__`, `__dict__` ...), no
  attribute chosen at run time (`getattr` / `setattr` / `attrgetter` with a computed name), no
  string naming any of these (format fields included), no private members of other modules
  (`random._os`), no assignment to another module's attributes, and no new `__eq__`, `__bool__`,
  `__hash__`, `__instancecheck__` ... (an object that equals everything passes any assertion).
  On top of these, an **allow-list of attribute names**: every attribute new code reads or writes
  must be one the library's own source uses, or a public member of a builtin type or of an
  allowlisted standard module (module-valued members excluded: `enum.bltns` is `builtins`); and
  no route that turns a string into code or a name lookup: string annotations, `typing.get_type_hints`
  / `inspect.get_annotations` / `eval_str=`, `singledispatch`, `make_dataclass`, `str.format`
  on a template that is not a literal, `string.Formatter`, `type()` with three arguments, stores
  to dunder attributes (`f.__module__ = ...`), dunder keyword arguments, class keywords and
  dunder names in new class bodies, new dunder methods beyond the plain protocol ones
  (`__reduce__`, `__getattr__`, `__init_subclass__` ...), and calls to the library's own helpers
  that look names up from strings (toolz's `_restore_curry`).
  A function is compared with its starting version: only references it did not have before
  count, so editing a function that already used `inspect.signature`, or fixing an `__eq__`, is fine.

A file that does not parse is passed through: Python cannot run it either, and its tests fail.

What this does not do: it is a static check of Python source, so it cannot prove an arbitrary
edit harmless (data built at run time can still reach a sink a function already had: that is
what the worker's run-time refusals are for, runner.py); it rejects every route to the machinery
we know of and leaves the rest to the judge process, the worker's audit hook and the canary
tests (runner.py, grader.py). It never runs the agent's code.
"""
from __future__ import annotations

import ast
import functools
import importlib
import re
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from envs.swe import libraries as L
from envs.swe.libraries import Library

# Standard modules new code may import and use freely: pure computation, no process, file,
# interpreter or test-framework access.
SAFE_MODULES = frozenset({
    "abc", "array", "bisect", "calendar", "cmath", "collections", "collections.abc", "contextlib", "copy",
    "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools", "heapq", "html", "itertools",
    "keyword", "math", "numbers", "operator", "pprint", "queue", "random", "re", "reprlib", "statistics", "string",
    "textwrap", "time", "typing", "unicodedata", "warnings",
})
# Modules that reach the interpreter, the process, files or the test framework (the worker's own
# `json` and `os` included): names bound to them may only be used as one of SAFE_MEMBERS.
MACHINERY_MODULES = frozenset({
    "sys", "os", "posix", "gc", "atexit", "inspect", "builtins", "importlib", "types", "ctypes", "_ctypes",
    "pytest", "_pytest", "pluggy", "unittest", "doctest", "json", "_json", "threading", "_thread", "subprocess",
    "multiprocessing", "concurrent", "asyncio", "signal", "traceback", "pickle", "_pickle", "copyreg", "marshal",
    "runpy", "pkgutil", "zipimport", "code", "codeop", "faulthandler", "tracemalloc", "resource", "io", "_io",
    "socket", "select", "selectors", "mmap", "fcntl", "pty", "shutil", "tempfile", "pathlib", "glob", "site",
    "sysconfig", "dis", "linecache", "tokenize", "logging", "contextvars", "weakref", "_weakref", "zipfile",
    "tarfile", "webbrowser", "http", "urllib", "_io", "_posixsubprocess", "_signal", "_imp", "_frozen_importlib",
})
# Members of other modules that are plain constants or pure helpers.
SAFE_MEMBERS = frozenset({
    "sys.maxsize", "sys.version_info", "sys.hexversion", "sys.byteorder", "sys.float_info", "sys.int_info",
    "sys.maxunicode", "sys.getrecursionlimit", "sys.getsizeof", "sys.intern", "sys.getdefaultencoding",
    "os.path", "os.sep", "os.linesep", "os.fspath", "os.PathLike", "os.curdir", "os.pardir",
    "inspect.signature", "inspect.Signature", "inspect.Parameter", "inspect.isclass", "inspect.isfunction",
    "inspect.ismethod", "inspect.isgeneratorfunction", "inspect.iscoroutinefunction", "inspect.isbuiltin",
    "inspect.isroutine", "inspect.isabstract", "inspect.getfullargspec", "inspect.unwrap", "inspect.cleandoc",
    "types.MethodType", "types.MappingProxyType", "types.GeneratorType",
    "types.BuiltinFunctionType", "types.FunctionType", "types.LambdaType", "types.GenericAlias", "types.NoneType",
    "io.StringIO", "io.BytesIO",
})
# Builtins that evaluate code, open files, or hand out namespaces.
BANNED_NAMES = frozenset({
    "eval", "exec", "compile", "globals", "locals", "vars", "__import__", "breakpoint", "open", "input", "help",
    "exit", "quit", "__builtins__", "__loader__", "__spec__",
})
# Attributes that lead to frames, code, the import system, hooks or the process, whatever the object.
BANNED_ATTRS = frozenset({
    "modules", "meta_path", "path_hooks", "path_importer_cache", "settrace", "setprofile", "gettrace", "getprofile",
    "_getframe", "_current_frames", "_current_exceptions", "addaudithook", "audit", "excepthook", "displayhook",
    "breakpointhook", "unraisablehook", "monitoring", "setrecursionlimit", "setswitchinterval", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "f_lasti", "tb_frame",
    "tb_next", "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code", "co_consts",
    "cell_contents", "currentframe", "getouterframes", "getinnerframes", "getframeinfo",
    "getmodule", "getmembers", "getattr_static", "get_objects", "get_referrers", "get_referents", "_exit", "abort",
    "kill", "killpg", "fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execlp", "execvp",
    "execvpe", "spawnv", "spawnl", "posix_spawn", "posix_spawnp", "import_module", "reload", "fdopen", "dup2",
    "get_field", "get_value",  # string.Formatter: attribute paths given as text
    # modules kept as private attributes of standard modules (`collections._sys`, `random._os`)
    "_sys", "_os", "_imp", "_bootstrap", "_bootstrap_external", "_io", "_json", "_pickle", "_thread", "_signal",
    "_weakref", "_ctypes", "_posixsubprocess", "_frozen_importlib",
})
# Standard-library routes from a string to code or to a name lookup: annotation evaluation,
# generated classes and format templates that walk attributes.
STRING_EVAL = frozenset({
    "get_type_hints", "get_annotations", "ForwardRef", "make_dataclass", "singledispatch",
    "singledispatchmethod", "Formatter", "format_map", "vformat", "warn_explicit", "new_class",
    "SimpleNamespace", "evaluate", "eval_str",
})
BANNED_ATTRS = BANNED_ATTRS | STRING_EVAL
# Modules reached as attributes of other modules (`functoolz.sys`, `tabulate.io`), except names
# too common as ordinary attributes to mean a module.
BANNED_ATTRS = BANNED_ATTRS | (MACHINERY_MODULES - {"code", "select", "site", "glob", "resource", "types"})
# Dunder attributes new code may use: the protocol methods and plain naming metadata. Everything
# else (`__globals__`, `__code__`, `__closure__`, `__dict__`, `__subclasses__`, `__mro__`,
# `__base__`, `__builtins__`, `__getattribute__`, `__reduce__`, `__self__` ...) is an escape route.
SAFE_DUNDERS = frozenset({
    "__init__", "__new__", "__call__", "__repr__", "__str__", "__format__", "__hash__", "__bool__", "__len__",
    "__iter__", "__next__", "__reversed__", "__contains__", "__getitem__", "__setitem__", "__delitem__",
    "__missing__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__radd__", "__iadd__",
    "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__",
    "__abs__", "__invert__", "__and__", "__rand__", "__iand__", "__or__", "__ror__", "__ior__", "__xor__",
    "__rxor__", "__ixor__", "__lshift__", "__rshift__", "__index__", "__int__", "__float__", "__complex__",
    "__round__", "__enter__", "__exit__", "__get__", "__set__", "__delete__", "__copy__", "__deepcopy__",
    "__name__", "__qualname__", "__doc__", "__module__", "__wrapped__", "__class__", "__signature__",
    "__slots__", "__all__", "__version__", "__length_hint__", "__sizeof__", "__await__",
    "__aiter__", "__anext__", "__aenter__", "__aexit__", "__matmul__", "__rmatmul__", "__divmod__",
    "__rdivmod__", "__trunc__", "__floor__", "__ceil__", "__bytes__", "__fspath__", "__text_signature__",
    "__isabstractmethod__", "__array__", "__array_interface__", "__html__", "__dataclass_fields__",
})
# Methods that decide what `==`, `bool()`, `isinstance()` say: an object defining them anew can
# make any assertion hold ("always equal"); a fix edits such a method, it does not add one.
VERDICT_METHODS = frozenset({"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__",
                             "__hash__", "__instancecheck__", "__subclasscheck__", "__contains__"})
# Dunder names a function body may read as plain names.
SAFE_DUNDER_NAMES = frozenset({"__name__", "__doc__", "__class__", "__file__", "__debug__", "__qualname__",
                               "__module__"})
_SINK_CALLS = frozenset({"import_module", "__import__", "eval", "exec", "compile"})
_DYNAMIC_ATTR_FUNCS = frozenset({"getattr", "setattr", "delattr", "hasattr", "attrgetter", "methodcaller"})
_DUNDER = re.compile(r"^__\w+__$")
_DUNDER_ANYWHERE = re.compile(r"__[A-Za-z]\w*?__")
_FORMAT_FIELD = re.compile(r"\{([^{}]*)\}")
_IDENT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


RULES = ("new_file", "module_level", "forbidden", "unanalyzable")


@dataclass(frozen=True)
class Rejection:
    """Why one library file's edit is not graded. rule: new_file | module_level | forbidden | unanalyzable."""

    path: str
    rule: str
    line: int
    detail: str

    def render(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.detail}"


@dataclass(frozen=True)
class EditCheck:
    """The verdict on the whole edit set; `ok` when nothing was rejected. `graded`: for each
    changed file that parses, the text that runs (`splice`): the starting file with the agent's
    functions in place."""

    rejections: tuple[Rejection, ...] = ()
    unparsable: tuple[str, ...] = ()  # changed files that do not parse: passed through, they cannot run
    graded: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.rejections

    def rules(self) -> frozenset[str]:
        return frozenset(r.rule for r in self.rejections)


def check_edits(lib: Library, start: Mapping[str, bytes], library_files: Mapping[str, bytes]) -> EditCheck:
    """Validate every library file that differs from the starting repository (`start`)."""
    rejections: list[Rejection] = []
    unparsable: list[str] = []
    graded: dict[str, bytes] = {}
    vocab = _vocabulary(lib, start)
    for path in sorted(library_files):
        new = library_files[path]
        old = start.get(path)
        if old == new:
            continue
        if old is None:
            rejections.append(Rejection(path, "new_file", 1, "a file added to the package"))
            continue
        try:
            found = check_file(lib, path, old, new, vocab)
        except (SyntaxError, ValueError):  # ValueError: NUL bytes, which import refuses too
            unparsable.append(path)
            continue
        except (RecursionError, MemoryError) as e:  # too deep or degenerate to analyse
            found = [Rejection(path, "unanalyzable", 1, f"{type(e).__name__}: the file cannot be analysed")]
        if not found:
            try:
                graded[path] = splice(path, old, new)
            except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError) as e:
                found = [Rejection(path, "unanalyzable", 1, f"the edit cannot be reduced to function bodies: {e}")]
        rejections += found
    return EditCheck(tuple(rejections), tuple(unparsable), graded if not rejections else {})


def check_file(lib: Library, path: str, old: bytes, new: bytes,
               vocab: frozenset[str] | None = None) -> list[Rejection]:
    """Rejections for one changed file; SyntaxError when the new version does not parse."""
    own = _own_packages(lib)
    vocab = _vocabulary(lib, {path: old}) if vocab is None else vocab
    before = _analyse(path, old, own)
    after = _analyse(path, new, own, full=False)
    out: list[Rejection] = []
    if before.skeleton != after.skeleton:
        out.append(Rejection(path, "module_level", _first_difference(ast.parse(old), ast.parse(new), own),
                             "module-level (import-time) code changed: only the bodies of existing functions "
                             "(and constant default values) may change"))
    for key in _changed(before, after):
        # The new version may import what the starting one did, not what it imports itself, and
        # may not newly call the starting file's helpers that look names up from strings.
        def refs(a: _Analysis) -> Counter:
            if key not in a.units:
                return Counter()
            unit = a.units[key][1]
            # module-level imports are the starting file's (or the skeleton differs); the unit's own on top
            imports = {**before.imports, **_import_table(unit)}
            return Counter(_violations(unit, imports, own, before.importable, vocab, before.gadgets))
        found = refs(after)
        # By what, not where: an edit above a function moves its lines, not its references.
        extra = Counter(w for w, _ in found.elements()) - Counter(w for w, _ in refs(before).elements())
        lines = {w: ln for w, ln in sorted(found, key=lambda x: -x[1])}
        for what in sorted(extra)[:5]:
            out.append(Rejection(path, "forbidden", lines[what], f"{what} in {key[0]}"))
    return out


@dataclass(frozen=True)
class _Analysis:
    skeleton: str  # the import-time code, as an AST dump without positions
    imports: Mapping[str, str]  # local name -> dotted origin (_import_table)
    importable: frozenset[str]  # top-level modules code in this file may import (for a starting file)
    gadgets: frozenset[str]  # module-level functions that look names up from strings (import_module, getattr ...)
    units: Mapping[tuple[str, int], tuple[str, ast.AST]]  # function -> (its text from the `def` line, its node)


@functools.lru_cache(maxsize=8)  # the starting file is the same for every episode of an instance
def _analyse(path: str, data: bytes, own: frozenset[str], full: bool = True) -> _Analysis:
    """What import-time code a file has and its functions; with `full`, also what it imports and
    its string-lookup helpers (a starting file: what it imports, an optional dependency such as
    tabulate's `wcwidth` but no machinery, new code may import again). SyntaxError / ValueError
    when Python cannot compile it."""
    tree = ast.parse(data, filename=path)
    skeleton = _skeleton(tree)
    imports = _import_table(tree) if full else {}
    importable = own | frozenset(o.split(".")[0] for o in imports.values() if o.split(".")[0] not in MACHINERY_MODULES)
    # Text only to tell which functions changed (a function with the same text is not taken from
    # the agent); undecodable bytes compare as replacement characters and fail the splice.
    lines = data.decode("utf-8", "replace").splitlines(keepends=True)
    units = {key: ("".join(lines[n.lineno - 1:n.end_lineno]), n) for key, n in _unit_nodes(tree)}  # type: ignore[attr-defined]
    return _Analysis(skeleton, imports, importable, _gadgets(tree) if full else frozenset(), units)


def _changed(before: _Analysis, after: _Analysis) -> list[tuple[str, int]]:
    """The agent's functions whose text differs from the starting version (or that are new)."""
    return [k for k, (text, _) in after.units.items() if k not in before.units or before.units[k][0] != text]


def _gadgets(tree: ast.Module) -> frozenset[str]:
    """Module-level functions whose bodies turn strings into modules, attributes or code: calling
    one with a string built at run time reaches anything (toolz's `_restore_curry`)."""
    out = set()
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(node):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            computed = any(not (isinstance(a, ast.Constant) and isinstance(a.value, str)) for a in n.args[1:2])
            if name in _SINK_CALLS or (name in _DYNAMIC_ATTR_FUNCS and computed):
                out.add(node.name)
                break
    return frozenset(out)


# ----------------------------------------------------------------------------- the attribute allow-list
_BUILTIN_TYPES = (str, bytes, bytearray, list, tuple, dict, set, frozenset, int, float, complex, bool, range,
                  slice, memoryview, object, BaseException, property, staticmethod, classmethod)


@functools.lru_cache(maxsize=1)
def _standard_vocabulary() -> frozenset[str]:
    """Public members of the builtin types and of the allowlisted standard modules (and of the
    classes those modules define), minus module-valued members and the string-evaluating ones."""
    names = {"send", "throw", "close", "mro"}  # generators and classes, without their frame / code attributes
    for t in _BUILTIN_TYPES:
        names |= {n for n in dir(t) if not n.startswith("_")}
    for m in sorted(SAFE_MODULES):
        mod = importlib.import_module(m)
        for n in dir(mod):
            v = getattr(mod, n, None)
            if n.startswith("_") or isinstance(v, types.ModuleType):
                continue
            names.add(n)
            if isinstance(v, type):
                names |= {x for x in dir(v) if not x.startswith("_")}
    return frozenset(n for n in names if not _banned_attr(n))


@functools.lru_cache(maxsize=64)
def _file_vocabulary(path: str, data: bytes) -> frozenset[str]:
    try:
        tree = ast.parse(data, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()
    return frozenset(n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute))


@functools.lru_cache(maxsize=8)
def _release_vocabulary(lib: Library) -> frozenset[str]:
    """Attribute names of the pinned release's library files (empty when it is not cached)."""
    if lib.name not in L.LIBRARIES or L.get_library(lib.name) != lib:
        return frozenset()
    try:
        files = L.source_files(lib)
    except Exception:  # noqa: BLE001 - not downloaded: the starting files alone
        return frozenset()
    return frozenset().union(*(_file_vocabulary(p, b) for p, b in files.items() if lib.is_library_path(p)))


def _vocabulary(lib: Library, start: Mapping[str, bytes]) -> frozenset[str]:
    """The attribute names new code may use: those the library's own code uses (the pinned
    release; the starting files where no release is cached) and the standard vocabulary. (A
    starting file is the release with one bug injected, which only ever removes names.)"""
    own = _release_vocabulary(lib) or frozenset().union(
        *(_file_vocabulary(p, b) for p, b in start.items() if lib.is_library_path(p)))
    return own | _standard_vocabulary()


def _own_packages(lib: Library) -> frozenset[str]:
    return frozenset(p.rsplit("/", 1)[-1] for p in lib.packages)


def _is_constant(e: ast.expr | None) -> bool:
    """A plain constant (`True`, `3`, `-1.5`, `None`, `'x'`): evaluating it runs nothing."""
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
        e = e.operand
    return isinstance(e, ast.Constant)


def _module_ok(name: str, own: frozenset[str]) -> bool:
    return name in SAFE_MODULES or name.split(".")[0] in own


class _Strip(ast.NodeTransformer):
    """Import-time code only: the bodies of functions that are not nested in functions emptied
    and their constant defaults replaced by a placeholder; docstrings and `pass` dropped from
    module and class bodies. Everything else (new functions, imports, lambdas, decorators,
    annotations) stays, so that any change to it shows. Every change is logged in `undo`."""

    def __init__(self) -> None:
        self.undo: list[tuple[ast.AST, str, object]] = []

    def _set(self, node: ast.AST, field_name: str, value: object) -> None:
        self.undo.append((node, field_name, getattr(node, field_name)))
        setattr(node, field_name, value)

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        kept = []
        for s in body:
            if isinstance(s, ast.Pass):
                continue
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
                continue
            kept.append(self.visit(s))
        return kept

    def visit_Module(self, node: ast.Module) -> ast.AST:
        self._set(node, "body", self._body(node.body))
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        self._set(node, "body", self._body(node.body))  # bases, keywords, decorators hold no functions to strip
        return node

    def visit_FunctionDef(self, node: ast.AST) -> ast.AST:
        self._set(node, "body", [])
        a = node.args  # type: ignore[attr-defined]
        self._set(a, "defaults", [ast.Constant("<constant>") if _is_constant(d) else d for d in a.defaults])
        self._set(a, "kw_defaults", [ast.Constant("<constant>") if _is_constant(d) else d for d in a.kw_defaults])
        return node

    visit_AsyncFunctionDef = visit_FunctionDef


def _skeleton(tree: ast.Module, own: frozenset[str] = frozenset()) -> str:
    """The dump of `tree`'s import-time code; `tree` is left as it was."""
    strip = _Strip()
    try:
        return ast.dump(strip.visit(tree), include_attributes=False)
    finally:
        for node, field_name, value in reversed(strip.undo):
            setattr(node, field_name, value)


def _first_difference(old: ast.Module, new: ast.Module, own: frozenset[str]) -> int:
    """The line of the first top-level statement whose import-time code differs (for the message)."""
    def tops(t: ast.Module) -> list[tuple[str, int]]:
        out = []
        for s in t.body:
            m = ast.Module(body=[s], type_ignores=[])
            d = _skeleton(m, own)
            if d != ast.dump(ast.Module(body=[], type_ignores=[]), include_attributes=False):
                out.append((d, s.lineno))
        return out
    a, b = tops(old), tops(new)
    for i, (d, line) in enumerate(b):
        if i >= len(a) or a[i][0] != d:
            return line
    return b[-1][1] if b else 1


# ----------------------------------------------------------------------------- run-time code
def _unit_nodes(tree: ast.Module) -> list[tuple[tuple[str, int], ast.AST]]:
    """Every function that is not nested in another one (with what nests in it), keyed by
    (qualname, occurrence), in source order."""
    seen: Counter[str] = Counter()
    found: list[tuple[tuple[str, int], ast.AST]] = []

    class Find(ast.NodeVisitor):
        prefix = ""

        def visit_FunctionDef(self, node: ast.AST) -> None:
            q = self.prefix + node.name  # type: ignore[attr-defined]
            seen[q] += 1
            found.append(((q, seen[q]), node))

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_ClassDef(self, node: ast.ClassDef) -> None:
            outer = self.prefix
            self.prefix = outer + node.name + "."
            self.generic_visit(node)
            self.prefix = outer

    Find().visit(tree)
    return found


def _dump(node: ast.AST) -> str:
    return ast.dump(node, include_attributes=False)


def splice(path: str, old: bytes, new: bytes) -> bytes:
    """The file that runs for an accepted edit: `old`'s text with each function of `new` whose text
    differs from its starting version put in place of that version (from its `def` line to its
    end; decorators stay `old`'s), re-indented to the starting column. Raises ValueError unless
    the result parses to exactly `old`'s import-time code, `new`'s changed functions and `old`'s
    other functions."""
    before, after = _analyse(path, old, frozenset(), full=False), _analyse(path, new, frozenset(), full=False)
    if before.units.keys() != after.units.keys():
        raise ValueError("the functions differ from the starting file's")
    lines, n_lines = old.decode("utf-8").splitlines(keepends=True), new.decode("utf-8").splitlines(keepends=True)
    changed = _changed(before, after)
    for k in sorted(changed, key=lambda k: -before.units[k][1].lineno):  # bottom up: earlier lines stay put
        o, n = before.units[k][1], after.units[k][1]
        block = n_lines[n.lineno - 1:n.end_lineno]  # type: ignore[attr-defined]
        pre_o, pre_n = lines[o.lineno - 1][:o.col_offset], block[0][:n.col_offset]  # type: ignore[attr-defined]
        if pre_o != pre_n:
            block = [pre_o + b[len(pre_n):] if b.startswith(pre_n) else b for b in block]
        if not block[-1].endswith(("\n", "\r")):
            block[-1] += "\n"
        lines[o.lineno - 1:o.end_lineno] = block  # type: ignore[attr-defined]
    out = "".join(lines).encode("utf-8")
    got = _analyse(path, out, frozenset(), full=False)
    if got.skeleton != before.skeleton or got.units.keys() != before.units.keys():
        raise ValueError("the import-time code did not survive the splice unchanged")
    for k, (text, node) in got.units.items():
        if (k in changed and _dump(node) != _dump(after.units[k][1])) or (k not in changed and text != before.units[k][0]):
            raise ValueError(f"{k[0]} did not survive the splice unchanged")
    return out


def _import_table(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin for every import in the file (module level or not)."""
    table: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                table[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            for a in n.names:
                table[a.asname or a.name] = f"{n.module}.{a.name}"
    return table


def _banned_attr(attr: str) -> bool:
    return attr in BANNED_ATTRS or (_DUNDER.match(attr) is not None and attr not in SAFE_DUNDERS)




def _banned_string(value: str) -> bool:
    """A string that names an escape route: used as an attribute, key or module name, or inside a
    format field (`"{0.__globals__}"`), or naming a verdict method (`type(n, b, {"__eq__": f})`)."""
    if any(_banned_attr(d) or d in VERDICT_METHODS for d in _DUNDER_ANYWHERE.findall(value)):
        return True
    for field in _FORMAT_FIELD.findall(value):
        if any(_banned_attr(w) for w in re.findall(r"[A-Za-z_]\w*", field)):
            return True
    if not _IDENT_PATH.match(value):
        return False
    return any(p in BANNED_NAMES or _banned_attr(p) or p in MACHINERY_MODULES for p in value.split("."))


_CODE_NODES = (ast.Call, ast.Lambda, ast.Import, ast.ImportFrom, ast.NamedExpr, ast.ListComp, ast.SetComp,
               ast.DictComp, ast.GeneratorExp, ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AugAssign)


def _holds_code(value: str) -> bool:
    """A string that parses as Python doing something (a call, a lambda, an import, a binding):
    `typing.get_type_hints` and friends evaluate the strings a library hands them as annotations."""
    if len(value) > 20_000 or "(" not in value and "=" not in value and "import" not in value:
        return False
    try:
        tree = ast.parse(value.strip())
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(x, _CODE_NODES) for x in ast.walk(tree))


def _dotted(e: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(e, ast.Attribute):
        parts.append(e.attr)
        e = e.value
    if isinstance(e, ast.Name):
        return [e.id] + parts[::-1]
    return None


def _violations(unit: ast.AST, imports: Mapping[str, str], own: frozenset[str],
                importable: frozenset[str], vocab: frozenset[str] = frozenset(),
                gadgets: frozenset[str] = frozenset()) -> Iterator[tuple[str, int]]:
    """(what, line) for every reference in `unit` that new code may not make. `own`: the
    library's packages; `importable`: other top-level modules it may import besides SAFE_MODULES;
    `vocab`: the attribute allow-list (empty: not applied); `gadgets`: helpers it may not call."""
    docstrings = set()
    for n in ast.walk(unit):
        body = getattr(n, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add(id(body[0].value))
    parents: dict[int, ast.AST] = {}
    for n in ast.walk(unit):
        for c in ast.iter_child_nodes(n):
            parents[id(c)] = n

    def origin(name: str) -> str | None:
        o = imports.get(name)
        if o is None:
            return None
        top = o.split(".")[0]
        return None if top in own else o

    annotations = set()
    for n in ast.walk(unit):
        if isinstance(n, ast.arg) and n.annotation is not None:
            annotations.add(id(n.annotation))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            annotations.add(id(n.returns))
        elif isinstance(n, ast.AnnAssign):
            annotations.add(id(n.annotation))
    for n in ast.walk(unit):
        if id(n) in annotations and any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in ast.walk(n)):
            yield "string annotation", getattr(n, "lineno", 0)  # typing.get_type_hints evaluates it

    for n in ast.walk(unit):
        line = getattr(n, "lineno", 0)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in VERDICT_METHODS:
            yield f"defines {n.name}", line
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in VERDICT_METHODS:
            yield f"defines {n.id}", line
        # dunder hooks the interpreter calls implicitly (__reduce__, __getattr__, __init_subclass__ ...)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _DUNDER.match(n.name) \
                and n.name not in SAFE_DUNDERS:
            yield f"defines {n.name}", line
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and _DUNDER.match(n.id):
            yield f"binds {n.id}", line
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and _DUNDER.match(n.id) \
                and n.id not in SAFE_DUNDER_NAMES:
            yield f"use of {n.id}", line
        if isinstance(n, ast.Name) and n.id in gadgets:
            yield f"use of {n.id} (it looks names up from strings)", line
        if isinstance(n, ast.ClassDef):
            for k in n.keywords:
                yield f"class keyword {k.arg or '**'}", line
        if isinstance(n, ast.keyword) and n.arg is not None and (_DUNDER.match(n.arg) or n.arg in STRING_EVAL):
            yield f"keyword argument {n.arg}", line
        if isinstance(n, ast.Attribute):
            if vocab and n.attr not in vocab and not _banned_attr(n.attr):
                yield f"attribute {n.attr} (not in the allow-list)", line
            if isinstance(n.ctx, (ast.Store, ast.Del)) and _DUNDER.match(n.attr):
                yield f"assignment to attribute {n.attr}", line
            if n.attr == "format" and not (isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)):
                yield "format with a template that is not a literal", line
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "type" \
                and (len(n.args) > 1 or n.keywords):
            yield "type() building a class", line
        if isinstance(n, ast.Import):
            for a in n.names:
                if not _module_ok(a.name, importable):
                    yield f"import {a.name}", line
        elif isinstance(n, ast.ImportFrom):
            if n.level == 0 and not _module_ok(n.module or "", importable):
                yield f"import from {n.module}", line
            for a in n.names:
                if _banned_attr(a.name) or a.name in BANNED_NAMES:
                    yield f"import of {a.name}", line
        elif isinstance(n, ast.Name):
            if n.id in BANNED_NAMES:
                yield f"use of {n.id}", line
            parent = parents.get(id(n))
            if n.id in _DYNAMIC_ATTR_FUNCS or origin(n.id) in ("operator.attrgetter", "operator.methodcaller"):
                if not (isinstance(parent, ast.Call) and parent.func is n):
                    yield f"{n.id} passed as a value", line
            o = origin(n.id)
            if o is not None and o.split(".")[0] in MACHINERY_MODULES:
                # A name bound to a machinery module (or one of its members): allowed only as a safe member.
                chain = [n.id]
                p: ast.AST | None = parent
                node: ast.AST = n
                while isinstance(p, ast.Attribute) and p.value is node:
                    chain.append(p.attr)
                    node, p = p, parents.get(id(p))
                full = ".".join([o] + chain[1:])
                if not any(full == m or full.startswith(m + ".") for m in SAFE_MEMBERS):
                    yield f"use of {full}", line
        elif isinstance(n, ast.Attribute):
            if _banned_attr(n.attr):
                yield f"attribute {n.attr}", line
            elif n.attr.startswith("_") and not _DUNDER.match(n.attr) and isinstance(n.value, ast.Name) \
                    and origin(n.value.id) is not None:
                yield f"private member {origin(n.value.id)}.{n.attr}", line  # `random._os` and the like
            if isinstance(n.ctx, (ast.Store, ast.Del)):
                chain = _dotted(n.value)
                if chain and origin(chain[0]) is not None:
                    yield f"assignment to {origin(chain[0])}.{'.'.join(chain[1:] + [n.attr])}", line
        elif isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in _DYNAMIC_ATTR_FUNCS or (isinstance(f, ast.Name) and origin(f.id) in
                                               ("operator.attrgetter", "operator.methodcaller")):
                names = n.args[1:2] if name in ("getattr", "setattr", "delattr", "hasattr") else n.args
                for a in names:  # a constant name is checked as a string below
                    if not (isinstance(a, ast.Constant) and isinstance(a.value, str)):
                        yield f"{name} with a computed name", line
                if name in ("setattr", "delattr") and n.args:
                    chain = _dotted(n.args[0])
                    if chain and origin(chain[0]) is not None:
                        yield f"{name} on {origin(chain[0])}", line
            if n.keywords and any(k.arg is None for k in n.keywords) and name in _DYNAMIC_ATTR_FUNCS:
                yield f"{name} with ** arguments", line
            if n.args and any(isinstance(a, ast.Starred) for a in n.args) and name in _DYNAMIC_ATTR_FUNCS:
                yield f"{name} with * arguments", line
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            if _banned_string(n.value):
                yield f"string {n.value[:60]!r}", line
            elif _holds_code(n.value):
                yield f"string holding code {n.value[:60]!r}", line  # an annotation evaluator would run it
        elif isinstance(n, ast.JoinedStr):
            pass  # its constant parts are visited as Constants
