"""Validating the agent's library edits before they are graded: what new code may do at all.

The library runs in the same interpreter as pytest (runner.py), so an edit that reaches pytest,
the interpreter's hooks or the process itself could make failing tests report a pass. This
module decides, from the source alone, whether an edit stays within what a bug fix needs:

* **No new files** in the package (a new module is new code that runs when something imports it;
  grader.py drops them before this check, which rejects any that reach it).
* **No module-level code.** Every file's import-time code (module and class bodies, decorators,
  default values, base classes: everything but function and lambda bodies) must be the starting
  file's, except for two additions that execute nothing: an undecorated `def` whose defaults and
  annotations are plain names or constants, and an `import` of an allowlisted standard module.
  Docstrings and `pass` may change.
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
  A function is compared with its starting version: only references it did not have before
  count, so editing a function that already used `inspect.signature`, or fixing an `__eq__`, is fine.

A file that does not parse is passed through: Python cannot run it either, and its tests fail.

What this does not do: it is a static check of Python source, so it cannot prove an arbitrary
edit harmless; it rejects every route to the machinery we know of and leaves the rest to the
judge process, the worker's audit hook and the canary tests (runner.py, grader.py). It never
runs the agent's code.
"""
from __future__ import annotations

import ast
import functools
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Mapping

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
    "types.MethodType", "types.MappingProxyType", "types.SimpleNamespace", "types.GeneratorType",
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
    "__annotations__", "__slots__", "__all__", "__version__", "__length_hint__", "__sizeof__", "__await__",
    "__aiter__", "__anext__", "__aenter__", "__aexit__", "__matmul__", "__rmatmul__", "__divmod__",
    "__rdivmod__", "__trunc__", "__floor__", "__ceil__", "__bytes__", "__fspath__", "__text_signature__",
    "__isabstractmethod__", "__array__", "__array_interface__", "__html__", "__dataclass_fields__",
})
# Methods that decide what `==`, `bool()`, `isinstance()` say: an object defining them anew can
# make any assertion hold ("always equal"); a fix edits such a method, it does not add one.
VERDICT_METHODS = frozenset({"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__",
                             "__hash__", "__instancecheck__", "__subclasscheck__", "__contains__"})
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
    """The verdict on the whole edit set; `ok` when nothing was rejected."""

    rejections: tuple[Rejection, ...] = ()
    unparsable: tuple[str, ...] = ()  # changed files that do not parse: passed through, they cannot run

    @property
    def ok(self) -> bool:
        return not self.rejections

    def rules(self) -> frozenset[str]:
        return frozenset(r.rule for r in self.rejections)


def check_edits(lib: Library, start: Mapping[str, bytes], library_files: Mapping[str, bytes]) -> EditCheck:
    """Validate every library file that differs from the starting repository (`start`)."""
    rejections: list[Rejection] = []
    unparsable: list[str] = []
    for path in sorted(library_files):
        new = library_files[path]
        old = start.get(path)
        if old == new:
            continue
        if old is None:
            rejections.append(Rejection(path, "new_file", 1, "a file added to the package"))
            continue
        try:
            found = check_file(lib, path, old, new)
        except (SyntaxError, ValueError):  # ValueError: NUL bytes, which import refuses too
            unparsable.append(path)
            continue
        except (RecursionError, MemoryError) as e:  # too deep or degenerate to analyse
            found = [Rejection(path, "unanalyzable", 1, f"{type(e).__name__}: the file cannot be analysed")]
        rejections += found
    return EditCheck(tuple(rejections), tuple(unparsable))


def check_file(lib: Library, path: str, old: bytes, new: bytes) -> list[Rejection]:
    """Rejections for one changed file; SyntaxError when the new version does not parse."""
    own = _own_packages(lib)
    before = _analyse(path, old, own, None)
    # The new version may import what the starting one did, not what it imports itself.
    after = _analyse(path, new, own, before.importable)
    out: list[Rejection] = []
    if before.skeleton != after.skeleton:
        out.append(Rejection(path, "module_level", _first_difference(ast.parse(old), ast.parse(new), own),
                             "module-level (import-time) code changed: only function bodies, undecorated "
                             "new functions and allowlisted imports may change"))
    for key, found in after.units.items():
        # By what, not where: an edit above a function moves its lines, not its references.
        extra = Counter(w for w, _ in found.elements()) - Counter(w for w, _ in before.units.get(key, Counter()).elements())
        lines = {w: ln for w, ln in sorted(found, key=lambda x: -x[1])}
        for what in sorted(extra)[:5]:
            out.append(Rejection(path, "forbidden", lines[what], f"{what} in {key[0]}"))
    return out


@dataclass(frozen=True)
class _Analysis:
    skeleton: str  # the import-time code, as an AST dump without positions
    units: Mapping[tuple[str, int], Counter]  # per function: (what, line) -> count of forbidden references
    importable: frozenset[str]  # top-level modules code in this file may import


@functools.lru_cache(maxsize=32)  # the starting file is the same for every episode of an instance
def _analyse(path: str, data: bytes, own: frozenset[str], importable: frozenset[str] | None) -> _Analysis:
    """`importable` None: this is a starting file, and what it imports (an optional dependency such
    as tabulate's `wcwidth`, but no machinery) may be imported again by new code."""
    skeleton = _skeleton(ast.parse(data, filename=path), own)
    tree = ast.parse(data, filename=path)
    imports = _import_table(tree)
    if importable is None:
        importable = own | frozenset(o.split(".")[0] for o in imports.values()
                                     if o.split(".")[0] not in MACHINERY_MODULES)
    units = {key: Counter(_violations(node, imports, own, importable)) for key, node in _units(tree)}
    return _Analysis(skeleton, units, importable)


# ----------------------------------------------------------------------------- import-time code
def _own_packages(lib: Library) -> frozenset[str]:
    return frozenset(p.rsplit("/", 1)[-1] for p in lib.packages)


def _is_inert_expr(e: ast.expr | None) -> bool:
    """Evaluating it at import time runs no code of ours: a constant or a dotted name."""
    if e is None or isinstance(e, ast.Constant):
        return True
    if isinstance(e, ast.Name):
        return e.id not in BANNED_NAMES
    if isinstance(e, ast.Attribute):
        return _is_inert_expr(e.value) and not _banned_attr(e.attr)
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        return isinstance(e.operand, ast.Constant)
    if isinstance(e, (ast.Tuple, ast.List)):
        return all(_is_inert_expr(x) for x in e.elts)
    if isinstance(e, ast.Subscript):
        return _is_inert_expr(e.value) and _is_inert_expr(e.slice)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.BitOr):  # `int | None` annotations
        return _is_inert_expr(e.left) and _is_inert_expr(e.right)
    return False


def _is_inert_def(s: ast.stmt) -> bool:
    if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) or s.decorator_list:
        return False
    a = s.args
    exprs = list(a.defaults) + [d for d in a.kw_defaults if d is not None] + [s.returns]
    exprs += [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None]
    return all(_is_inert_expr(e) for e in exprs)


def _is_safe_import(s: ast.stmt, own: frozenset[str]) -> bool:
    if isinstance(s, ast.Import):
        return all(_module_ok(a.name, own) for a in s.names)
    if isinstance(s, ast.ImportFrom):
        return s.level > 0 or _module_ok(s.module or "", own)
    return False


def _module_ok(name: str, own: frozenset[str]) -> bool:
    return name in SAFE_MODULES or name.split(".")[0] in own


class _Strip(ast.NodeTransformer):
    """Import-time code only: function and lambda bodies emptied; inert defs, allowlisted imports,
    docstrings and `pass` dropped from module and class bodies."""

    def __init__(self, own: frozenset[str]) -> None:
        self.own = own

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        kept = []
        for s in body:
            if _is_inert_def(s) or _is_safe_import(s, self.own) or isinstance(s, ast.Pass):
                continue
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
                continue
            kept.append(self.visit(s))
        return kept

    def visit_Module(self, node: ast.Module) -> ast.AST:
        node.body = self._body(node.body)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        self.generic_visit(node)
        node.body = self._body(node.body)
        return node

    def visit_FunctionDef(self, node: ast.AST) -> ast.AST:
        node.body = []  # type: ignore[attr-defined]
        node.decorator_list = [self.visit(d) for d in node.decorator_list]  # type: ignore[attr-defined]
        node.args = self.visit(node.args)  # type: ignore[attr-defined]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        node.args = self.visit(node.args)
        node.body = ast.Constant(None)
        return node


def _skeleton(tree: ast.Module, own: frozenset[str]) -> str:
    """Consumes `tree` (the transform edits it in place)."""
    return ast.dump(_Strip(own).visit(tree), include_attributes=False)


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
def _units(tree: ast.Module) -> Iterator[tuple[tuple[str, int], ast.AST]]:
    """Every function that is not nested in another one (with what nests in it), keyed by
    (qualname, occurrence); then the rest of the module, where functions are left out, as one unit
    (its import-time code is pinned by the skeleton; lambda bodies are what can differ there)."""
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

    class Drop(ast.NodeTransformer):
        def visit_FunctionDef(self, node: ast.AST) -> ast.AST:
            return ast.Pass()

        visit_AsyncFunctionDef = visit_FunctionDef

    Find().visit(tree)
    yield from found
    yield ("<module level>", 1), Drop().visit(tree)  # last: this edits `tree` in place


def _import_table(tree: ast.Module) -> dict[str, str]:
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


def _dotted(e: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(e, ast.Attribute):
        parts.append(e.attr)
        e = e.value
    if isinstance(e, ast.Name):
        return [e.id] + parts[::-1]
    return None


def _violations(unit: ast.AST, imports: Mapping[str, str], own: frozenset[str],
                importable: frozenset[str]) -> Iterator[tuple[str, int]]:
    """(what, line) for every reference in `unit` that new code may not make. `own`: the
    library's packages; `importable`: other top-level modules it may import besides SAFE_MODULES."""
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

    for n in ast.walk(unit):
        line = getattr(n, "lineno", 0)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in VERDICT_METHODS:
            yield f"defines {n.name}", line
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in VERDICT_METHODS:
            yield f"defines {n.id}", line
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
        elif isinstance(n, ast.JoinedStr):
            pass  # its constant parts are visited as Constants
