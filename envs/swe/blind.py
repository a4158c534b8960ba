"""Blinding the tested copy: what a test computes only to compare with never reaches the tested process.

observe.py turns each assertion into an observation and lets the host compare the library's values
with the pristine library's. An operand that does not depend on the library (`expected = "\\n".join([...])`,
`list(filter(isodd, range(5)))`, the `expected` column of a table a loop walks) reports the same value in
both runs, so it adds nothing to the verdict, but as long as it is computed in the tested process, code
with full control there can read it (a caller's frame, the heap) and return it. This module removes such
values from the copy the tested process gets, across the test modules of one library:

- **Library-independent operands** (`independent`): built from constants, builtins and pure standard
  modules, the test modules' own pure helper functions and *expected-only* variables; evaluating them has
  no effect on anything that stays. They are dropped from the observation like literals are.
- **Expected-only variables** (greatest fixpoint): a variable whose every binding is such an expression
  and whose every use is a dropped operand, the binding of another expected-only variable, a `print`
  argument or an argument to an expected-only helper parameter. Their bindings are removed; a loop over a
  table (`for x, expected in [(1, 2), ...]`, also through a local name bound to the table) keeps its rows
  and its other columns, with the expected column set to `None`.
- **Expected-only helper parameters** (`assert_equal(expected, result)` in another module): a parameter of
  a module-level helper that every call site feeds with a library-independent value and that the helper
  only compares with. Call sites pass `None` for it.

What stays, by design: a value that is also an input of the library (it must be there for the call), or
that decides the flow (a loop bound, an `if`), and values behind constructs the analysis does not follow
(`pytest.mark.parametrize` tables, fixtures, class attributes, mutation through method calls). Those are
counted by `blind_stats` (docs/swe.md). The analysis is conservative: when in doubt, a value stays, so a
blinded test behaves as the original does except that it reports fewer values, in the grading run and in
the reference run alike.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Iterable, Mapping

OBSERVE_NAME = "_jointrl_observe"

# Builtins whose result depends only on their arguments and that change nothing outside them.
PURE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "chr", "complex", "dict", "divmod",
    "enumerate", "filter", "float", "format", "frozenset", "hex", "int", "isinstance", "issubclass", "iter",
    "len", "list", "map", "max", "min", "object", "oct", "ord", "pow", "range", "repr", "reversed", "round",
    "set", "slice", "sorted", "str", "sum", "tuple", "type", "zip", "None", "True", "False", "Ellipsis",
    "NotImplemented", "ArithmeticError", "AssertionError", "AttributeError", "Exception", "IndexError",
    "KeyError", "LookupError", "RuntimeError", "StopIteration", "TypeError", "ValueError",
    "ZeroDivisionError"})
# Standard modules with no process-wide state a test could change through them (random is not here:
# the library under test may draw from it).
PURE_MODULES = frozenset({"itertools", "functools", "operator", "math", "string", "collections", "decimal",
                          "fractions", "textwrap", "numbers", "fnmatch", "keyword", "unicodedata", "copy",
                          "statistics", "cmath", "re", "datetime", "enum"})
# Methods that read their receiver: calling one on a library-independent value changes nothing.
READING_METHODS = frozenset({
    "join", "split", "rsplit", "splitlines", "strip", "lstrip", "rstrip", "replace", "format", "upper",
    "lower", "title", "capitalize", "casefold", "swapcase", "center", "ljust", "rjust", "zfill", "expandtabs",
    "encode", "decode", "startswith", "endswith", "find", "rfind", "index", "rindex", "count", "partition",
    "rpartition", "keys", "values", "items", "get", "copy", "isdigit", "isalpha", "isalnum", "isspace",
    "isupper", "islower", "isdecimal", "isnumeric", "isidentifier", "isprintable", "istitle", "union",
    "intersection", "difference", "symmetric_difference", "issubset", "issuperset", "isdisjoint", "hex",
    "fromkeys", "from_iterable", "most_common", "elements", "translate", "maketrans", "removeprefix",
    "removesuffix", "bit_length", "conjugate", "as_integer_ratio", "is_integer"})
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass
class BlindStats:
    """What blinding removed, over a set of test modules."""

    operands_dropped: int = 0  # library-independent operands (literals are dropped before: observe.py)
    bindings_removed: int = 0  # assignments of expected-only variables
    columns_cleared: int = 0  # table columns set to None
    parameters_cleared: int = 0  # call-site arguments of expected-only helper parameters
    print_args_dropped: int = 0


@dataclass
class _Module:
    path: str
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> "pure" | "helper:<mod>:<name>" | "other"
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)  # module-level defs
    globals_bound: set[str] = field(default_factory=set)


def _stem(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return name[:-3] if name.endswith(".py") else name


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    out: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def _bound_names(scope: ast.AST) -> set[str]:
    """Names bound directly in a function (or module) scope, nested scopes and comprehensions excluded."""
    out: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        out |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
        out |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    body = scope.body if isinstance(scope.body, list) else [scope.body]  # (a class body is a list too)
    stack = list(body)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            stack.extend(n.decorator_list)
            continue
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            out |= set(n.names)
        if isinstance(n, (ast.Lambda, *_COMPS)):
            continue
        stack.extend(ast.iter_child_nodes(n))
    return out


def _is_print(call: ast.AST) -> bool:
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print"


class Blinder:
    """The analysis and rewrite over one library's test modules (already turned into observations)."""

    def __init__(self, modules: Mapping[str, ast.Module]):
        self.mods = {p: _Module(p, t) for p, t in modules.items()}
        stems: dict[str, list[str]] = {}
        for p in self.mods:
            stems.setdefault(_stem(p), []).append(p)
        self.by_stem = {s: ps[0] for s, ps in stems.items() if len(ps) == 1}
        self.parent: dict[ast.AST, ast.AST] = {}
        self.scope_of: dict[ast.AST, ast.AST] = {}  # node -> its enclosing function / module
        self.module_of: dict[ast.AST, _Module] = {}
        for m in self.mods.values():
            self.parent.update(_parents(m.tree))
            self._index(m)
        self.bound = {s: _bound_names(s) for s in self._scopes()}
        self._build_refs()
        self.pure_functions = self._pure_functions()
        # (module path, function name) -> parameter names every call site feeds independently
        self.helper_params: dict[tuple[str, str], set[str]] = {}
        self.expected: dict[ast.AST, set[str]] = {}  # scope -> its expected-only variables

    # ------------------------------------------------------------------ indexing
    def _index(self, m: _Module) -> None:
        for node in m.tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    m.imports[(a.asname or top)] = "pure" if top in PURE_MODULES and not a.asname or (
                        a.name in PURE_MODULES) else "other"
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                top = mod.split(".")[0]
                for a in node.names:
                    local = a.asname or a.name
                    if not node.level and top in PURE_MODULES:
                        m.imports[local] = "pure"
                    elif mod.split(".")[-1] in self.by_stem if mod else False:
                        m.imports[local] = f"helper:{self.by_stem[mod.split('.')[-1]]}:{a.name}"
                    else:
                        m.imports[local] = "other"
            elif isinstance(node, ast.FunctionDef) and not node.decorator_list:
                m.functions[node.name] = node
        m.globals_bound = _bound_names(m.tree)
        # scope of every node (a class body is a scope of its own; functions inside it do not see it)
        stack: list[tuple[ast.AST, ast.AST]] = [(m.tree, m.tree)]
        while stack:
            node, scope = stack.pop()
            self.scope_of[node] = scope
            self.module_of[node] = m
            inner = node if isinstance(node, _SCOPES) else scope
            for child in ast.iter_child_nodes(node):
                # decorators, bases, defaults and annotations are evaluated in the enclosing scope
                enclosing = isinstance(node, _SCOPES) and (
                    child in getattr(node, "decorator_list", []) or child is getattr(node, "args", None)
                    or child in getattr(node, "bases", []) or child in getattr(node, "keywords", [])
                    or child is getattr(node, "returns", None))
                stack.append((child, scope if enclosing else inner))

    def _scopes(self) -> Iterable[ast.AST]:
        for m in self.mods.values():
            yield m.tree
            for n in ast.walk(m.tree):
                if isinstance(n, _SCOPES):
                    yield n

    def _build_refs(self) -> None:
        """Every load resolved once to the scope that binds it; every store by its own scope."""
        self.loads: dict[tuple[int, str], list[ast.Name]] = {}
        self.stores: dict[tuple[int, str], list[ast.Name]] = {}
        self.declared_global: set[tuple[str, str]] = set()
        for m in self.mods.values():
            for n in ast.walk(m.tree):
                if isinstance(n, ast.Global):
                    self.declared_global |= {(m.path, x) for x in n.names}
                if not isinstance(n, ast.Name):
                    continue
                if isinstance(n.ctx, ast.Load):
                    if self._comp_local(n):
                        continue
                    kind, ref = self._resolve(n.id, self.scope_of[n])
                    if kind in ("local", "global"):
                        self.loads.setdefault((id(ref), n.id), []).append(n)
                else:
                    self.stores.setdefault((id(self.scope_of[n]), n.id), []).append(n)

    def _resolve(self, name: str, scope: ast.AST) -> tuple[str, object]:
        """What a loaded name refers to from `scope`: ("local", scope) | ("global", module) |
        ("pure", None) | ("helper", (path, fname)) | ("other", None)."""
        s: ast.AST | None = scope
        m = self.module_of[scope]
        if isinstance(s, ast.ClassDef):
            if name in self.bound[s]:
                return "other", None  # a class attribute: not followed
            s = self.scope_of.get(s)
        while s is not None and s is not m.tree:
            if isinstance(s, ast.ClassDef):  # functions do not see their class's names
                s = self.scope_of.get(s)
                continue
            if name in self.bound[s]:
                return "local", s
            s = self.scope_of.get(s)  # the scope that encloses this function
        if name in m.imports:
            kind = m.imports[name]
            if kind.startswith("helper:"):
                _, path, fname = kind.split(":", 2)
                return ("helper", (path, fname)) if fname in self.mods[path].functions else ("other", None)
            return (kind, None)
        if name in m.functions:
            return "helper", (m.path, name)
        if name in m.globals_bound:
            return "global", m.tree
        if name in PURE_BUILTINS:
            return "pure", None
        return "other", None

    # ------------------------------------------------------------------ purity
    def _pure_functions(self) -> set[tuple[str, str]]:
        """Module-level helpers that compute from their arguments only (greatest fixpoint)."""
        cand = {(m.path, f) for m in self.mods.values() for f in m.functions}
        changed = True
        while changed:
            changed = False
            for key in sorted(cand):
                fn = self.mods[key[0]].functions[key[1]]
                if not self._body_pure(fn, cand):
                    cand.discard(key)
                    changed = True
        return cand

    def _body_pure(self, fn: ast.FunctionDef, cand: set) -> bool:
        for n in ast.walk(fn):
            if isinstance(n, (ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await, ast.ClassDef)):
                return False
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                kind, ref = self._resolve(n.id, self.scope_of[n])
                if kind == "local" or kind == "pure":
                    continue
                if kind == "helper" and ref in cand:
                    continue
                return False
            if isinstance(n, ast.Attribute) and n.attr.startswith("__"):
                return False
        return True

    def independent(self, e: ast.AST, expected: Mapping[ast.AST, set[str]] | None = None) -> bool:
        """Whether `e` evaluates to the same value whatever the library does, and changes nothing
        that stays when it is not evaluated."""
        expected = self.expected if expected is None else expected
        for n in ast.walk(e):
            if isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)):
                return False
            if isinstance(n, ast.Attribute) and (n.attr.startswith("__") or not isinstance(n.ctx, ast.Load)):
                return False
            if isinstance(n, (ast.Subscript, ast.Starred)) and not isinstance(n.ctx, ast.Load):
                return False
            if isinstance(n, ast.Call):
                f = n.func
                if isinstance(f, ast.Attribute) and not self._module_attr(f) and f.attr not in READING_METHODS:
                    return False
                if isinstance(f, ast.Name) and f.id in ("next", "print"):
                    return False
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                if self._inner_local(n, e):
                    continue
                kind, ref = self._resolve(n.id, self.scope_of[n])
                if kind == "pure" or (kind == "helper" and ref in self.pure_functions):
                    continue
                if kind in ("local", "global") and n.id in expected.get(ref, ()):
                    continue
                return False
        return True

    def _module_attr(self, f: ast.Attribute) -> bool:
        """`math.floor(...)`: a function of a pure standard module."""
        return isinstance(f.value, ast.Name) and self._resolve(f.value.id, self.scope_of[f.value])[0] == "pure"

    def _inner_local(self, n: ast.Name, root: ast.AST) -> bool:
        """A name bound by a comprehension or lambda inside `root` (its value comes from inside `root`)."""
        p = self.parent.get(n)
        while p is not None and p is not root:
            if isinstance(p, _COMPS) and any(n.id in {t.id for t in ast.walk(g.target) if isinstance(t, ast.Name)}
                                             for g in p.generators):
                return True
            if isinstance(p, ast.Lambda) and n.id in _bound_names(p):
                return True
            p = self.parent.get(p)
        return p is root and isinstance(root, ast.Lambda) and n.id in _bound_names(root)

    # ------------------------------------------------------------------ the analysis
    def _call_sites(self) -> dict[tuple[str, str], list[ast.Call] | None]:
        """Calls of each module-level helper; None when it is also used as a value or called with * / **."""
        sites: dict[tuple[str, str], list[ast.Call] | None] = {}
        for m in self.mods.values():
            for n in ast.walk(m.tree):
                if not (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)):
                    continue
                kind, ref = self._resolve(n.id, self.scope_of[n])
                if kind != "helper":
                    continue
                call = self.parent.get(n)
                ok = (isinstance(call, ast.Call) and call.func is n
                      and not any(isinstance(a, ast.Starred) for a in call.args)
                      and all(k.arg is not None for k in call.keywords))
                if ref not in sites or sites[ref] is not None:
                    sites[ref] = (sites.get(ref) or []) + [call] if ok else None
        # a helper imported elsewhere but never called there stays usable as a value: be safe
        for m in self.mods.values():
            for node in m.tree.body:
                if isinstance(node, ast.ImportFrom):
                    for a in node.names:
                        kind = m.imports.get(a.asname or a.name, "")
                        if kind.startswith("helper:") and a.name == "*":
                            return {}
        return sites

    @staticmethod
    def _arg_for(call: ast.Call, fn: ast.FunctionDef, param: str) -> ast.expr | None:
        names = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
        if param in names and names.index(param) < len(call.args):
            return call.args[names.index(param)]
        for k in call.keywords:
            if k.arg == param:
                return k.value
        return None

    def _uses_dropped(self, n: ast.Name, expected: Mapping[ast.AST, set[str]],
                      params: Mapping[tuple[str, str], set[str]]) -> bool:
        """Whether a load of an expected-only candidate sits where blinding removes it."""
        child: ast.AST = n
        p = self.parent.get(n)
        while p is not None:
            if isinstance(p, ast.Call) and isinstance(p.func, ast.Name) and p.func.id == OBSERVE_NAME and child in p.args[3:]:
                return self.independent(child, expected)
            if _is_print(p) and child in p.args:
                return self.independent(child, expected)
            if isinstance(p, ast.Call) and child in [*p.args, *(k.value for k in p.keywords)] and isinstance(p.func, ast.Name):
                kind, ref = self._resolve(p.func.id, self.scope_of[p.func])
                if kind == "helper" and ref in params:
                    fn = self.mods[ref[0]].functions[ref[1]]
                    if any(self._arg_for(p, fn, q) is child for q in params[ref]):
                        return self.independent(child, expected)
            if isinstance(p, ast.Assign) and child is p.value:
                return self._binding_ok(p, expected)
            if isinstance(p, (ast.stmt, *_SCOPES)):
                return False
            child, p = p, self.parent.get(p)
        return False

    def _binding_ok(self, a: ast.Assign, expected) -> bool:
        scope = self.scope_of[a]
        names = [t.id for t in a.targets if isinstance(t, ast.Name)]
        return (len(names) == len(a.targets) and all(x in expected.get(scope, ()) for x in names)
                and self.independent(a.value, expected))

    def _table(self, f: ast.For) -> ast.expr | None:
        """The literal table a loop walks, directly or through a local name bound once to it."""
        it = f.iter
        if isinstance(it, ast.Name):
            scope = self.scope_of[f]
            kind, ref = self._resolve(it.id, scope)
            if kind != "local" or ref is not scope:
                return None
            binds = self.stores.get((id(scope), it.id), [])
            if (len(binds) != 1 or not isinstance(self.parent.get(binds[0]), ast.Assign)
                    or self._loads(scope, it.id) != [it]):  # the table is read by this loop alone
                return None
            a = self.parent[binds[0]]
            if a.targets != [binds[0]]:
                return None
            it = a.value
        if isinstance(it, (ast.List, ast.Tuple)) and it.elts:
            return it
        return None

    def _for_binding_ok(self, f: ast.For, name: str, expected) -> bool:
        table = self._table(f)
        if table is None:
            return False
        t = f.target
        if isinstance(t, ast.Name):
            return t.id == name and all(self._independent_const(r) for r in table.elts)
        if not isinstance(t, (ast.Tuple, ast.List)) or not all(isinstance(x, ast.Name) for x in t.elts):
            return False
        idx = [i for i, x in enumerate(t.elts) if x.id == name]
        if len(idx) != 1:
            return False
        return all(isinstance(r, (ast.Tuple, ast.List)) and len(r.elts) == len(t.elts)
                   and not any(isinstance(x, ast.Starred) for x in r.elts)
                   and self._independent_const(r.elts[idx[0]]) for r in table.elts)

    def _independent_const(self, e: ast.AST) -> bool:
        return self.independent(e, {})

    def _candidate_bindings_ok(self, scope: ast.AST, name: str, expected) -> bool:
        """Every binding of `name` in `scope` is a plain assignment of an independent value, or the
        column of a literal table a loop walks."""
        found = False
        if scope is self.module_of[scope].tree and (self.module_of[scope].path, name) in self.declared_global:
            return False
        for n in self.stores.get((id(scope), name), ()):
            found = True
            p = self.parent[n]
            if isinstance(p, ast.Assign) and n in p.targets:
                if not self._binding_ok(p, expected):
                    return False
            elif isinstance(p, (ast.Tuple, ast.List)) and isinstance(self.parent.get(p), ast.For) and self.parent[p].target is p:
                if not self._for_binding_ok(self.parent[p], name, expected):
                    return False
            elif isinstance(p, ast.For) and p.target is n:
                if not self._for_binding_ok(p, name, expected):
                    return False
            else:
                return False
        return found

    def _compare_only(self) -> dict[tuple[str, str], set[str]]:
        """Parameters of module-level helpers that the helper only reports (an observation operand
        as it is, a `print` argument, or such a parameter of another helper); greatest fixpoint."""
        sites = self._call_sites()
        params: dict[tuple[str, str], set[str]] = {}
        for ref, calls in sites.items():
            if calls is not None and ref[1] in self.mods[ref[0]].functions:
                fn = self.mods[ref[0]].functions[ref[1]]
                params[ref] = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args]
                               if a.arg != "self" and not self._candidate_stores(fn, a.arg)}
        changed = True
        while changed:
            changed = False
            for ref in params:
                fn = self.mods[ref[0]].functions[ref[1]]
                for q in sorted(params[ref]):
                    if not all(self._reported(n, params) for n in self._loads(fn, q)):
                        params[ref].discard(q)
                        changed = True
        return {k: v for k, v in params.items() if v}

    def _reported(self, n: ast.Name, params) -> bool:
        p = self.parent.get(n)
        if isinstance(p, ast.Call) and isinstance(p.func, ast.Name):
            if p.func.id == OBSERVE_NAME and n in p.args[3:]:
                return True
            kind, ref = self._resolve(p.func.id, self.scope_of[p.func])
            if kind == "helper" and ref in params:
                fn = self.mods[ref[0]].functions[ref[1]]
                return any(self._arg_for(p, fn, q) is n for q in params[ref])
        return self._print_arg(n) is not None

    def _print_arg(self, n: ast.AST) -> ast.expr | None:
        """The `print` argument `n` is part of (in the same scope), if any."""
        child, p = n, self.parent.get(n)
        while p is not None and not isinstance(p, (ast.stmt, *_SCOPES)):
            if _is_print(p) and child in p.args:
                return child
            child, p = p, self.parent.get(p)
        return None

    def analyse(self) -> None:
        params = self._compare_only()
        # candidates: every plain local / module variable (parameters stay: their values come from callers)
        expected: dict[ast.AST, set[str]] = {}
        for scope in self._scopes():
            if isinstance(scope, (ast.Lambda, ast.ClassDef)):
                continue
            names = set(self.bound[scope])
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = scope.args
                names -= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
                # names another scope binds (`global` / `nonlocal`) are read elsewhere too
                names -= {x for n in ast.walk(scope) if isinstance(n, (ast.Global, ast.Nonlocal)) for x in n.names}
            expected[scope] = names
        changed = True
        while changed:
            changed = False
            for scope, names in expected.items():
                for name in sorted(names):
                    ok = self._candidate_bindings_ok(scope, name, expected) and all(
                        self._uses_dropped(n, expected, params) for n in self._loads(scope, name))
                    if not ok:
                        names.discard(name)
                        changed = True
        self.expected = expected
        self.helper_params = params

    def _candidate_stores(self, scope: ast.AST, name: str) -> bool:
        return bool(self.stores.get((id(scope), name)))

    def _loads(self, scope: ast.AST, name: str) -> list[ast.Name]:
        """Every load that resolves to `name` of `scope` (nested functions and lambdas included)."""
        out = list(self.loads.get((id(scope), name), ()))
        m = self.module_of[scope]
        if scope is m.tree:  # a module variable another test module imports stays
            for other in self.mods.values():
                for node in ast.walk(other.tree):
                    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] == _stem(m.path):
                        if any(a.name in (name, "*") for a in node.names):
                            out.append(ast.Name(name))  # unparented: never a dropped use
        return out

    def _comp_local(self, n: ast.Name) -> bool:
        p = self.parent.get(n)
        while p is not None and not isinstance(p, (ast.stmt, ast.Module)):
            if isinstance(p, _COMPS) and any(n.id in {t.id for t in ast.walk(g.target) if isinstance(t, ast.Name)}
                                             for g in p.generators):
                return True
            p = self.parent.get(p)
        return False

    def _reports_param(self, e: ast.AST) -> bool:
        """`e` reads a reported-only parameter of its helper (a call site may have passed None)."""
        for n in ast.walk(e):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                kind, ref = self._resolve(n.id, self.scope_of[n])
                if kind == "local" and isinstance(ref, ast.FunctionDef):
                    key = (self.module_of[ref].path, ref.name)
                    if n.id in self.helper_params.get(key, ()) and self.mods[key[0]].functions.get(key[1]) is ref:
                        return True
        return False

    # ------------------------------------------------------------------ the rewrite
    def rewrite(self) -> BlindStats:
        st = BlindStats()
        # 1. operands
        for m in self.mods.values():
            for n in list(ast.walk(m.tree)):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == OBSERVE_NAME:
                    # the mask already has "s" where observe.py dropped a literal
                    old = iter(n.args[3:])
                    mask, keep = [], []
                    for ch in n.args[2].value:
                        if ch == "s":
                            mask.append(ch)
                            continue
                        o = next(old)
                        drop = self.independent(o)
                        st.operands_dropped += drop
                        mask.append("s" if drop else "v")
                        if not drop:
                            keep.append(o)
                    n.args = [n.args[0], n.args[1], ast.Constant("".join(mask)), *keep]
                elif _is_print(n):
                    kept = [a for a in n.args if not self.independent(a) and not self._reports_param(a)]
                    st.print_args_dropped += len(n.args) - len(kept)
                    n.args = kept
        # 2. helper arguments
        for m in self.mods.values():
            for n in list(ast.walk(m.tree)):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                    kind, ref = self._resolve(n.func.id, self.scope_of[n.func])
                    if kind == "helper" and ref in self.helper_params:
                        fn = self.mods[ref[0]].functions[ref[1]]
                        for q in self.helper_params[ref]:
                            arg = self._arg_for(n, fn, q)
                            if arg is None or not self.independent(arg):
                                continue
                            none = ast.copy_location(ast.Constant(None), arg)
                            if arg in n.args:
                                n.args[n.args.index(arg)] = none
                            else:
                                next(k for k in n.keywords if k.value is arg).value = none
                            st.parameters_cleared += 1
        # 3. bindings and table columns
        for scope, names in self.expected.items():
            for name in names:
                for n in self.stores.get((id(scope), name), ()):
                    p = self.parent[n]
                    if isinstance(p, ast.Assign):
                        p.value = ast.copy_location(ast.Constant(None), p.value)
                        st.bindings_removed += 1
                    else:
                        f = p if isinstance(p, ast.For) else self.parent[p]
                        table = self._table(f)
                        if table is None:
                            continue
                        for i, row in enumerate(table.elts):
                            if isinstance(f.target, ast.Name):
                                table.elts[i] = ast.copy_location(ast.Constant(None), row)
                            else:
                                j = [x.id for x in f.target.elts].index(name)
                                row.elts[j] = ast.copy_location(ast.Constant(None), row.elts[j])
                        st.columns_cleared += 1
        for m in self.mods.values():
            ast.fix_missing_locations(m.tree)
        return st


def blind(modules: Mapping[str, ast.Module]) -> BlindStats:
    """Blind `modules` (path -> observation-transformed tree) in place."""
    b = Blinder(modules)
    b.analyse()
    return b.rewrite()
