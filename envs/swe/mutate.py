"""AST-aware, token-level bug injection (in the style of SWE-smith's procedural modifications).

`enumerate_mutations(path, source)` walks the module's AST and proposes minimal edits, each a
replacement of one exact source span (found from AST node positions and `tokenize` tokens), so
the bytes outside that span, neighbouring lines and formatting included, are untouched:

  flip_comparison   `<`<->`>`, `<=`<->`>=`, `==`<->`!=`, `is`<->`is not`, `in`<->`not in`
  off_by_one        `<`<->`<=`, `>`<->`>=`; an integer literal n -> n+1 / n-1 in an index,
                    slice, arithmetic operand, comparison or range() argument
  swap_arguments    the first two positional arguments of a call swap places
  remove_condition  one operand of a two-operand `and` / `or` is dropped (`a and b` -> `a`);
                    a `not` is dropped (`not x` -> `x`)
  wrong_operator    `+`<->`-`, `*`->`+`, `/`->`*`, `//`->`/`, `%`->`//`, `<<`<->`>>`, `&`<->`|`,
                    `^`->`|`, `and`<->`or`, `+=`<->`-=`
  wrong_default     a literal default argument: True<->False, an int n -> n+1
  wrong_return      `return True`<->`return False`; `return a, b` -> `return b, a`;
                    `return <name>` -> `return None`

Only code inside a function (or method) body is mutated; module-level statements run at import,
where an edit tends to break every test. Every edit is checked to parse and to change the AST;
`Mutation.apply` / `Mutation.revert` are exact inverses on the text.

What this module does not do: decide which mutations make good tasks (build.py runs the tests).
"""
from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from typing import Iterator

KINDS = ("flip_comparison", "off_by_one", "swap_arguments", "remove_condition", "wrong_operator",
         "wrong_default", "wrong_return")

_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "!=", "!=": "==", "is": "is not", "is not": "is",
         "in": "not in", "not in": "in"}
_BOUNDARY = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}
_BINOP = {"+": "-", "-": "+", "*": "+", "/": "*", "//": "/", "%": "//", "<<": ">>", ">>": "<<", "&": "|",
          "|": "&", "^": "|"}
_AUG = {"+=": "-=", "-=": "+="}


@dataclass(frozen=True)
class Mutation:
    """One edit: replace `source[start:end]` (== `original`) with `replacement`.

    start / end are character offsets into the module's text; `line` is the 1-based line of
    `start`; `function` is the qualified name of the enclosing top-level function or method
    (`Class.method`), the unit the train / held-out split is made of.
    """

    kind: str
    path: str
    function: str
    start: int
    end: int
    original: str
    replacement: str
    line: int

    def apply(self, source: str) -> str:
        if source[self.start:self.end] != self.original:
            raise ValueError(f"{self.path}:{self.line}: the source at the mutation span is "
                             f"{source[self.start:self.end]!r}, expected {self.original!r}")
        return source[:self.start] + self.replacement + source[self.end:]

    def revert(self, mutated: str) -> str:
        end = self.start + len(self.replacement)
        if mutated[self.start:end] != self.replacement:
            raise ValueError(f"{self.path}:{self.line}: the mutated span is {mutated[self.start:end]!r}, "
                             f"expected {self.replacement!r}")
        return mutated[:self.start] + self.original + mutated[end:]

    def describe(self) -> str:
        return f"{self.path}:{self.line} {self.function} {self.kind}: {self.original!r} -> {self.replacement!r}"


class _Text:
    """Maps AST (line, UTF-8 byte column) and tokenize (line, char column) positions to char offsets."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for ln in self.lines:
            self.starts.append(self.starts[-1] + len(ln))
        self.tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                       if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                         tokenize.COMMENT, tokenize.ENDMARKER)]
        self.tok_offsets = [(self.char(t.start), self.char(t.end), t) for t in self.tokens]

    def char(self, pos: tuple[int, int]) -> int:
        line, col = pos
        return self.starts[line - 1] + col

    def ast_start(self, node: ast.AST) -> int:
        line = self.lines[node.lineno - 1]
        return self.starts[node.lineno - 1] + len(line.encode("utf-8")[:node.col_offset].decode("utf-8", "replace"))

    def ast_end(self, node: ast.AST) -> int:
        line = self.lines[node.end_lineno - 1]
        return self.starts[node.end_lineno - 1] + len(line.encode("utf-8")[:node.end_col_offset].decode("utf-8", "replace"))

    def tokens_between(self, lo: int, hi: int) -> list[tuple[int, int, tokenize.TokenInfo]]:
        """Tokens fully inside [lo, hi), brackets excluded (an operand may sit in parentheses)."""
        return [x for x in self.tok_offsets if x[0] >= lo and x[1] <= hi and x[2].string not in "()"]

    def line_of(self, offset: int) -> int:
        lo, hi = 0, len(self.starts) - 1
        while lo < hi - 1:
            mid = (lo + hi) // 2
            if self.starts[mid] <= offset:
                lo = mid
            else:
                hi = mid
        return lo + 1


def _op_span(t: _Text, lo: int, hi: int) -> tuple[int, int, str] | None:
    toks = t.tokens_between(lo, hi)
    if not toks:
        return None
    text = " ".join(x[2].string for x in toks)
    return toks[0][0], toks[-1][1], text


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, def node) for top-level functions and methods of top-level classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{sub.name}", sub


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _proposals(t: _Text, fn: ast.AST) -> Iterator[tuple[str, int, int, str]]:
    """(kind, start, end, replacement) for every site inside one function (its defaults included)."""
    src = t.source
    args = fn.args  # type: ignore[attr-defined]
    for d in list(args.defaults) + [d for d in args.kw_defaults if d is not None]:
        if isinstance(d, ast.Constant) and type(d.value) is bool:
            yield "wrong_default", t.ast_start(d), t.ast_end(d), str(not d.value)
        elif _is_int(d):
            yield "wrong_default", t.ast_start(d), t.ast_end(d), str(d.value + 1)
    int_sites: set[int] = set()  # id() of int literals in places where off-by-one is meaningful
    for node in ast.walk(fn):
        if isinstance(node, ast.Subscript):
            sl = node.slice
            parts = [sl.lower, sl.upper, sl.step] if isinstance(sl, ast.Slice) else [sl]
            for p in parts:
                if p is not None:
                    for sub in ast.walk(p):
                        if _is_int(sub):
                            int_sites.add(id(sub))
        elif isinstance(node, ast.BinOp):
            for p in (node.left, node.right):
                if _is_int(p):
                    int_sites.add(id(p))
        elif isinstance(node, ast.Compare):
            for p in [node.left, *node.comparators]:
                if _is_int(p):
                    int_sites.add(id(p))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            for p in node.args:
                if _is_int(p):
                    int_sites.add(id(p))
    body_nodes = [n for stmt in fn.body for n in ast.walk(stmt)]  # type: ignore[attr-defined]
    for node in body_nodes:
        if isinstance(node, ast.Compare):
            prev = node.left
            for op_node, right in zip(node.ops, node.comparators):
                span = _op_span(t, t.ast_end(prev), t.ast_start(right))
                prev = right
                if span is None:
                    continue
                s, e, op = span
                if op in _FLIP:
                    yield "flip_comparison", s, e, _FLIP[op]
                if op in _BOUNDARY:
                    yield "off_by_one", s, e, _BOUNDARY[op]
        elif _is_int(node) and id(node) in int_sites:
            v = node.value
            yield "off_by_one", t.ast_start(node), t.ast_end(node), str(v + 1)
            if v >= 1:
                yield "off_by_one", t.ast_start(node), t.ast_end(node), str(v - 1)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2]):
            a, b = node.args[0], node.args[1]
            sa, ea, sb, eb = t.ast_start(a), t.ast_end(a), t.ast_start(b), t.ast_end(b)
            ta, tb = src[sa:ea], src[sb:eb]
            if ta != tb and "\n" not in src[sa:eb]:
                # One span covering both arguments, so the edit stays a single replacement.
                yield "swap_arguments", sa, eb, tb + src[ea:sb] + ta
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            a, b = node.values
            sa, ea, sb, eb = t.ast_start(a), t.ast_end(a), t.ast_start(b), t.ast_end(b)
            span = _op_span(t, ea, sb)
            if span is not None and span[2] in ("and", "or"):
                s, e, op = span
                yield "wrong_operator", s, e, "or" if op == "and" else "and"
                if "\n" not in src[sa:eb]:
                    yield "remove_condition", sa, eb, src[sa:ea]  # keep the first operand
                    yield "remove_condition", sa, eb, src[sb:eb]  # keep the second
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            s0 = t.ast_start(node)
            idx = next((i for i, x in enumerate(t.tok_offsets) if x[0] == s0), None)
            if idx is not None and t.tok_offsets[idx][2].string == "not" and idx + 1 < len(t.tok_offsets):
                # Delete `not` and the blank after it, up to the operand's first token (maybe a bracket).
                yield "remove_condition", s0, t.tok_offsets[idx + 1][0], ""
        elif isinstance(node, ast.BinOp):
            span = _op_span(t, t.ast_end(node.left), t.ast_start(node.right))
            if span is not None and span[2] in _BINOP:
                yield "wrong_operator", span[0], span[1], _BINOP[span[2]]
        elif isinstance(node, ast.AugAssign):
            span = _op_span(t, t.ast_end(node.target), t.ast_start(node.value))
            if span is not None and span[2] in _AUG:
                yield "wrong_operator", span[0], span[1], _AUG[span[2]]
        elif isinstance(node, ast.Return) and node.value is not None:
            v = node.value
            if isinstance(v, ast.Constant) and type(v.value) is bool:
                yield "wrong_return", t.ast_start(v), t.ast_end(v), str(not v.value)
            elif isinstance(v, ast.Tuple) and len(v.elts) == 2:
                a, b = v.elts
                sa, ea, sb, eb = t.ast_start(a), t.ast_end(a), t.ast_start(b), t.ast_end(b)
                if src[sa:ea] != src[sb:eb] and "\n" not in src[sa:eb]:
                    yield "wrong_return", sa, eb, src[sb:eb] + src[ea:sb] + src[sa:ea]
            elif isinstance(v, ast.Name) and v.id != "None":
                yield "wrong_return", t.ast_start(v), t.ast_end(v), "None"


def _parse_block(text: str, indent: int) -> ast.Module:
    """Parse a definition cut out of a module. An indented one (a method) goes under an `if 1:`
    header rather than being dedented, which would change multi-line string literals."""
    return ast.parse(text if indent == 0 else "if 1:\n" + text)


def enumerate_mutations(path: str, source: str) -> list[Mutation]:
    """Every valid mutation of `source` (a module at repo-relative `path`), in source order.

    Raises SyntaxError (with the path) if the module itself does not parse.
    """
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise SyntaxError(f"{path} does not parse: {e}") from None
    t = _Text(source)
    out: dict[tuple[int, int, str], Mutation] = {}
    for qualname, fn in _functions(tree):
        # Re-parse only the enclosing definition (dedented), not the whole module: a def is a
        # self-contained statement, so it parses alone iff the module does with the edit inside it.
        first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])  # type: ignore[attr-defined]
        lo, hi = t.starts[first - 1], t.starts[fn.end_lineno]  # type: ignore[attr-defined]
        indent = fn.col_offset  # type: ignore[attr-defined]
        base = ast.dump(_parse_block(source[lo:hi], indent))
        for kind, s, e, repl in _proposals(t, fn):
            orig = source[s:e]
            if not orig or orig == repl or (s, e, repl) in out:
                continue
            m = Mutation(kind=kind, path=path, function=qualname, start=s, end=e, original=orig,
                         replacement=repl, line=t.line_of(s))
            block = source[lo:s] + repl + source[e:hi]
            try:
                new_tree = _parse_block(block, indent)
            except SyntaxError:
                continue
            if ast.dump(new_tree) == base:
                continue
            out[(s, e, repl)] = m
    return sorted(out.values(), key=lambda m: (m.start, m.end, m.replacement))
