"""The project's own reading of answers that a reasoning-gym scorer would otherwise evaluate as code.

Several reasoning-gym 0.1.25 scorers turn the answer into a value with Python's `eval` or sympy's
`parse_expr` (itself an `eval`), in a scope that holds the task's entry and the whole sympy namespace. An
answer is then any program, and some programs reach the target without solving anything:
`entry['metadata']['valid_answers'][0]` in n_queens, `Integral(<the integrand>, x)` in the integration
domains, `expand(<the question>)` in polynomial_multiplication, digit-free arithmetic such as
`len('aaa…')` in countdown. puzzle24's scorer also never checks that the expression uses the puzzle's
numbers (`6*4*1*1` solves every puzzle), and coin_flip's partial credit for a matching prefix pays `0`
about 0.9 on every question.

So each such domain gets a rule here, applied by `domain.py` around the judge:
- `OWN_SCORERS`: the project scores the answer itself from a strict grammar (no evaluation of the
  answer as code anywhere): puzzle24, countdown (arithmetic over the task's numbers, exact rational
  value), coin_flip (a number or a fraction, within the scorer's tolerance, no prefix credit).
- `GATES`: the answer must pass an allow-listed grammar before reasoning-gym's scorer may see it (a
  sympy expression over the task's variables and elementary functions; a list / tuple literal); an
  answer the gate refuses scores 0 (`answer_refused`) and never reaches `eval`.
- `ALL_OR_NOTHING`: scorers whose partial credit one constant answer collects on most tasks; only a full
  score counts.

Every grammar is bounded (characters, nesting depth, node count, literal size, exponents) before any
parse, so a crafted answer costs microseconds. What this module does not do: sandbox anything (the judge
process does that for the scorers that still run), or judge answers of domains without a rule.
"""
from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping

# ----------------------------------------------------------------------------- arithmetic expressions
MAX_EXPR_CHARS = 512
MAX_DEPTH = 24          # parentheses and unary signs together
MAX_LITERALS = 24       # countdown's default config uses 4-6 numbers, puzzle24 4
MAX_LITERAL = 10 ** 6   # the largest number a default config draws is 100 (countdown); 999 as a target


class AnswerRefused(ValueError):
    """The answer is outside the domain's grammar (the message says where)."""


@dataclass(frozen=True)
class Arithmetic:
    value: Fraction
    numbers: tuple[int, ...]  # the integer literals, in the order written


_TOKEN = re.compile(r"[ \t\n]*(?:([0-9]+)|([-+*/()]))")


def _tokens(text: str) -> list[str]:
    if len(text) > MAX_EXPR_CHARS:
        raise AnswerRefused(f"longer than {MAX_EXPR_CHARS} characters")
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise AnswerRefused(f"unexpected {text[pos:pos + 8].strip()[:1]!r} at {pos}: only integers, + - * / and parentheses")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


def parse_arithmetic(text: str) -> Arithmetic:
    """Integers, binary + - * /, unary + -, parentheses; exact rational value.

    Grammar (recursive descent, depth-bounded):  expr := term (('+'|'-') term)*
    term := unary (('*'|'/') unary)*   unary := ('+'|'-') unary | atom   atom := INT | '(' expr ')'"""
    toks = _tokens(text)
    if not toks:
        raise AnswerRefused("empty expression")
    pos = 0
    numbers: list[int] = []

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def expr(depth: int) -> Fraction:
        v = term(depth)
        while peek() in ("+", "-"):
            v = v + term(depth) if take() == "+" else v - term(depth)
        return v

    def term(depth: int) -> Fraction:
        v = unary(depth)
        while peek() in ("*", "/"):
            op = take()
            w = unary(depth)
            if op == "*":
                v = v * w
            elif w == 0:
                raise AnswerRefused("division by zero")
            else:
                v = v / w
        return v

    def unary(depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise AnswerRefused(f"nested deeper than {MAX_DEPTH}")
        t = peek()
        if t in ("+", "-"):
            take()
            v = unary(depth + 1)
            return v if t == "+" else -v
        if t == "(":
            take()
            v = expr(depth + 1)
            if peek() != ")":
                raise AnswerRefused("unbalanced parentheses")
            take()
            return v
        if t is None or not t.isdigit():
            raise AnswerRefused(f"expected a number, got {t!r}")
        take()
        if len(t) > 7 or int(t) > MAX_LITERAL:
            raise AnswerRefused(f"number {t[:12]} larger than {MAX_LITERAL}")
        numbers.append(int(t))
        if len(numbers) > MAX_LITERALS:
            raise AnswerRefused(f"more than {MAX_LITERALS} numbers")
        return Fraction(int(t))

    value = expr(0)
    if pos != len(toks):
        raise AnswerRefused(f"unexpected {toks[pos]!r} after the expression")
    return Arithmetic(value, tuple(numbers))


def _meta_numbers(entry: Mapping[str, Any]) -> list[int]:
    nums = entry["metadata"]["numbers"]
    nums = json.loads(nums) if isinstance(nums, str) else nums
    return sorted(int(n) for n in nums)


def score_puzzle24(answer: str, entry: Mapping[str, Any]) -> float:
    """1 when the expression uses exactly the puzzle's four numbers, each once, and equals 24; else
    reasoning-gym's floor of 0.01 (its scorer's value for any wrong or malformed answer)."""
    try:
        a = parse_arithmetic(answer)
    except AnswerRefused:
        return 0.01
    return 1.0 if sorted(a.numbers) == _meta_numbers(entry) and a.value == 24 else 0.01


def score_countdown(answer: str, entry: Mapping[str, Any]) -> float:
    """reasoning-gym's levels with an exact check: 1 when every given number is used once and the value is
    the target; 0.05 for a well-formed expression that misses either; 0.01 when it is not arithmetic."""
    try:
        a = parse_arithmetic(answer)
    except AnswerRefused:
        return 0.01
    ok = sorted(a.numbers) == _meta_numbers(entry) and a.value == int(entry["metadata"]["target"])
    return 1.0 if ok else 0.05


_NUMBER = re.compile(r"[+-]?([0-9]{1,30}(\.[0-9]{0,30})?|\.[0-9]{1,30})([eE][+-]?[0-9]{1,3})?")


def score_coin_flip(answer: str, entry: Mapping[str, Any], tol: float = 1e-4) -> float:
    """1 when the answer (a decimal, or a fraction p/q; commas ignored) is within `tol` of the oracle
    probability, as reasoning-gym's scorer, and within 1% of it; 0 otherwise. Its partial credit for a matching prefix of the
    decimal expansion is dropped: `0` earns 0.9 against `0.0546875` there, on almost every question."""
    text = answer.replace(",", "").strip()
    if not text or len(text) > 80:
        return 0.0
    parts = text.split("/")
    if len(parts) > 2 or not all(_NUMBER.fullmatch(p.strip()) for p in parts):
        return 0.0
    try:
        value = Fraction(parts[0].strip()) / (Fraction(parts[1].strip()) if len(parts) == 2 else 1)
        oracle = Fraction(str(entry["answer"]).replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return 0.0
    err = abs(value - oracle)
    # Also within 1% of the oracle: with the absolute tolerance alone, "0" is right for every probability
    # below 1e-4 (15 heads in 15 flips: 3.05e-05).
    return 1.0 if err <= Fraction(tol) and err <= abs(oracle) / 100 else 0.0


# ----------------------------------------------------------------------------- gates in front of `eval`
MAX_GATE_CHARS = 4096
MAX_NODES = 4096
MAX_EXPONENT = 64          # |a constant exponent|: x**64 is far beyond any reference answer
MAX_INT_DIGITS = 18
MAX_CONST_BITS = 4096      # a constant subexpression's numerator and denominator
ELEMENTARY = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh",
                        "tanh", "coth", "asinh", "acosh", "atanh", "exp", "log", "sqrt", "Abs"})
CONSTANTS = frozenset({"pi", "E"})
_ARITH_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)


def _parse_bounded(text: str) -> ast.expression:
    if len(text) > MAX_GATE_CHARS:
        raise AnswerRefused(f"longer than {MAX_GATE_CHARS} characters")
    depth = peak = signs = 0
    for ch in text:  # bound the nesting (brackets, chains of signs) before Python's parser sees it
        depth += ch in "([{"
        depth -= ch in ")]}"
        peak = max(peak, depth)
        signs = signs + 1 if ch in "+-~" else signs if ch.isspace() else 0
        if signs > MAX_DEPTH:
            raise AnswerRefused(f"more than {MAX_DEPTH} signs in a row")
    if peak > MAX_DEPTH:
        raise AnswerRefused(f"nested deeper than {MAX_DEPTH}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise AnswerRefused(f"not an expression: {type(e).__name__}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise AnswerRefused(f"more than {MAX_NODES} syntax nodes")
    return tree


def _const_value(node: ast.AST, depth: int = 0) -> Fraction | None:
    """The exact value of a subtree made only of numbers, + - * /, signs and integer powers (None when it
    holds a name, a call or a fractional power). Refuses powers that would leave MAX_CONST_BITS."""
    if depth > 4 * MAX_DEPTH:
        raise AnswerRefused("nested too deeply")
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value) if math.isfinite(node.value) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _const_value(node.operand, depth + 1)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if not isinstance(node, ast.BinOp) or not isinstance(node.op, _ARITH_OPS):
        return None
    a, b = _const_value(node.left, depth + 1), _const_value(node.right, depth + 1)
    if isinstance(node.op, ast.Pow):
        if b is not None and abs(b) > MAX_EXPONENT:
            raise AnswerRefused(f"exponent beyond ±{MAX_EXPONENT}")
        if a is None or b is None or b.denominator != 1:
            return None
        if a == 0 and b < 0:
            return None
        bits = max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(int(b))
        if bits > MAX_CONST_BITS:
            raise AnswerRefused(f"a constant power beyond {MAX_CONST_BITS} bits")
        return a ** int(b)
    if a is None or b is None:
        return None
    if isinstance(node.op, ast.Div):
        return None if b == 0 else a / b
    v = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    if max(v.numerator.bit_length(), v.denominator.bit_length()) > MAX_CONST_BITS:
        raise AnswerRefused(f"a constant beyond {MAX_CONST_BITS} bits")
    return v


def check_symbolic(text: str, names: frozenset[str], functions: frozenset[str] = ELEMENTARY) -> None:
    """Raise `AnswerRefused` unless `text` is an expression of numbers, the given `names`, + - * / **, signs,
    parentheses and one-argument calls of `functions`. A constant exponent must lie within ±MAX_EXPONENT
    and a constant power within MAX_CONST_BITS (`9**9**9` never reaches sympy)."""
    tree = _parse_bounded(text)

    def walk(node: ast.AST, depth: int) -> None:
        if depth > 4 * MAX_DEPTH:
            raise AnswerRefused("nested too deeply")
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise AnswerRefused(f"literal {type(v).__name__} not allowed")
            if isinstance(v, int) and len(str(abs(v))) > MAX_INT_DIGITS:
                raise AnswerRefused(f"integer with more than {MAX_INT_DIGITS} digits")
            if isinstance(v, float) and not math.isfinite(v):
                raise AnswerRefused("non-finite number")
            return
        if isinstance(node, ast.Name):
            if node.id not in names and node.id not in CONSTANTS:
                raise AnswerRefused(f"name {node.id!r} not allowed (allowed: {', '.join(sorted(names | CONSTANTS))})")
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return walk(node.operand, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITH_OPS):
            if isinstance(node.op, ast.Pow):
                _const_value(node)  # bounds constant exponents and constant powers (raises beyond them)
            walk(node.left, depth + 1)
            walk(node.right, depth + 1)
            return
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in functions:
                what = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
                raise AnswerRefused(f"call of {what!r} not allowed (allowed: {', '.join(sorted(functions))})")
            if node.keywords or len(node.args) != 1 or isinstance(node.args[0], ast.Starred):
                raise AnswerRefused(f"{node.func.id}() takes exactly one positional argument here")
            return walk(node.args[0], depth + 1)
        raise AnswerRefused(f"{type(node).__name__} not allowed")

    walk(tree.body, 0)


def check_literal(text: str, *, max_depth: int = 3) -> None:
    """Raise `AnswerRefused` unless `text` is a list / tuple literal of numbers and strings (nested at most
    `max_depth` deep): what `eval` would turn into the same value as `ast.literal_eval`, and nothing else."""
    tree = _parse_bounded(text)

    def walk(node: ast.AST, depth: int) -> None:
        if isinstance(node, (ast.List, ast.Tuple)):
            if depth >= max_depth:
                raise AnswerRefused(f"nested deeper than {max_depth}")
            for e in node.elts:
                walk(e, depth + 1)
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            node = node.operand
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) and not isinstance(node.value, bool):
            if isinstance(node.value, int) and len(str(abs(node.value))) > MAX_INT_DIGITS:
                raise AnswerRefused(f"integer with more than {MAX_INT_DIGITS} digits")
            return
        raise AnswerRefused(f"{type(node).__name__} not allowed in a literal")

    walk(tree.body, 0)


def _parses(text: str) -> bool:
    try:
        _parse_bounded(text)
    except AnswerRefused:
        return False
    return True


def literal_or_text(answer: str, entry: Mapping[str, Any]) -> None:
    """The gate of the scorers that compare the text and otherwise `eval` it (binary_matrix, spiral_matrix,
    string_insertion, n_queens): the answer passes when it equals the reference text (after stripping),
    when it is a plain list / tuple literal, or when Python cannot parse it at all (then `eval` raises
    in the scorer and only its text comparison is left). Any other expression is refused: it would run."""
    if answer.strip() == str(entry.get("answer") or "").strip():
        return
    if isinstance(entry.get("metadata"), Mapping) and answer in (entry["metadata"].get("valid_answers") or ()):
        return
    if not _parses(answer):
        return
    check_literal(answer)


def _integration_names(entry: Mapping[str, Any]) -> frozenset[str]:
    return frozenset({str(entry["metadata"]["variable"]), "C"})


def integration_gate(answer: str, entry: Mapping[str, Any]) -> None:
    """The antiderivative: the task's variable, the constant C, elementary functions. No `Integral`,
    `integrate`, `diff` or any other sympy name (which would compute the answer from the question)."""
    check_symbolic(answer, _integration_names(entry))


def polynomial_gate(answer: str, entry: Mapping[str, Any]) -> None:
    """The expanded product: numbers, the task's variables, + - * ** and parentheses; no calls at all."""
    variables = entry["metadata"].get("variables") or ()
    check_symbolic(answer, frozenset(str(v) for v in variables), functions=frozenset())


# Scorers whose partial credit a constant collects: per-cell credit on grids that are mostly one value
# (game_of_life: an all-dead grid earned 0.96 on held-out), per-cell credit against a fixed sudoku
# (mini_sudoku: 0.30), credit for closeness to a duration (time_intervals: 0.42 for one fixed duration),
# credit for roots near the true ones (polynomial_equations: 0.40 for "0"), 0.25 for any tautology or bare
# atom, which follows from every set of premises (propositional_logic: "entry['answer']" parses as an atom).
# For these only a full score counts; anything less is 0.
ALL_OR_NOTHING = frozenset({"game_of_life", "mini_sudoku", "time_intervals", "polynomial_equations",
                            "propositional_logic"})

OwnScorer = Callable[[str, Mapping[str, Any]], float]
Gate = Callable[[str, Mapping[str, Any]], None]

OWN_SCORERS: dict[str, OwnScorer] = {
    "puzzle24": score_puzzle24,
    "countdown": score_countdown,
    "coin_flip": score_coin_flip,
}
GATES: dict[str, Gate] = {
    "simple_integration": integration_gate,
    "intermediate_integration": integration_gate,
    "polynomial_multiplication": polynomial_gate,
    "binary_matrix": literal_or_text,
    "spiral_matrix": literal_or_text,
    "string_insertion": literal_or_text,
    "n_queens": literal_or_text,
}


def reference_ok(dataset: str, reference: str, entry: Mapping[str, Any]) -> bool:
    """Whether the generator's reference answer is a valid answer under the project's rule for `dataset`
    (scores 1 with the own scorer, or passes the gate). True for datasets without a rule."""
    if dataset in OWN_SCORERS:
        return OWN_SCORERS[dataset](reference, entry) == 1.0
    if dataset in GATES:
        try:
            GATES[dataset](reference, entry)
        except AnswerRefused:
            return False
    return True
