"""envs/reasoning_gym/answers.py: the project's grammars for answers that reasoning-gym scorers would `eval`.

Values are checked against a slow reference written from the grammar (an explicit expression tree
evaluated with `Fraction`), the scorers against reasoning-gym's own on honest answers, and every
grammar against the attacks it exists for (calls, names, attributes, subscripts, towers of powers,
nesting floods), each refused within milliseconds (50 calls timed together). No judge process: fast."""
from __future__ import annotations

import random
import time
from fractions import Fraction

import pytest

from envs.reasoning_gym.answers import (MAX_EXPR_CHARS, AnswerRefused, check_literal, check_symbolic, literal_or_text,
                                        parse_arithmetic, score_coin_flip, score_countdown, score_puzzle24)


def _random_tree(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.3:
        n = rng.randint(1, 100)
        return str(n), Fraction(n), [n]
    op = rng.choice("+-*/")
    (ls, lv, ln), (rs, rv, rn) = _random_tree(rng, depth - 1), _random_tree(rng, depth - 1)
    if op == "/" and rv == 0:
        op = "+"
    value = {"+": lambda: lv + rv, "-": lambda: lv - rv, "*": lambda: lv * rv, "/": lambda: lv / rv}[op]()
    return f"({ls} {op} {rs})", value, ln + rn


def test_arithmetic_values_match_a_tree_evaluated_by_hand():
    rng = random.Random(0)
    for _ in range(500):
        text, value, nums = _random_tree(rng, rng.randint(1, 4))
        if len(nums) > 24:
            continue
        got = parse_arithmetic(text)
        assert got.value == value and list(got.numbers) == nums, text
    # precedence and associativity without parentheses: the usual left-to-right rules
    assert parse_arithmetic("8 - 5 - 2").value == 1
    assert parse_arithmetic("12 / 3 / 2").value == 2
    assert parse_arithmetic("2 + 3 * 4 - 6 / 3").value == 12
    assert parse_arithmetic("-(3 - 5) * 2").value == 4


@pytest.mark.parametrize("attack", [
    "len('aaaaaaaaaaaaaaaaaaaaaaaa')", "2**3", "0x18", "1e1", "2.5*2", "__import__('os')", "entry",
    "(1+2", "1+2)", "1 2", "", "   ", "1/0", "1/(2-2)", "9" * 8, "+".join(["1"] * 25), "(" * 30 + "1" + ")" * 30,
    "-" * 30 + "1", "x" * (MAX_EXPR_CHARS + 1), "(" * 100_000, "6×4", "６*4",
])
def test_arithmetic_refuses_everything_but_integers_and_four_operators(attack):
    t0 = time.perf_counter()
    for _ in range(50):  # timed over 50 calls: one call's time is noise on a loaded machine
        with pytest.raises(AnswerRefused):
            parse_arithmetic(attack)
    assert time.perf_counter() - t0 < 2.0  # 40 ms a call at most, on a machine at load 20


def _entry(numbers, target=None, answer=""):
    meta = {"numbers": numbers}
    if target is not None:
        meta["target"] = target
    return {"question": "", "answer": answer, "metadata": meta}


def test_puzzle24_needs_the_puzzles_own_numbers():
    e = _entry([8, 5, 10, 6])
    assert score_puzzle24("10*(8 - 5) - 6", e) == 1.0
    assert score_puzzle24("(8-5)*10-6", e) == 1.0
    # reasoning-gym's scorer accepts any four numbers in range that make 24: this one solves every puzzle
    assert score_puzzle24("6*4*1*1", e) == 0.01
    assert score_puzzle24("10*(8 - 5) - 6 + 0", e) == 0.01        # an extra number
    assert score_puzzle24("10*(8 - 5) + 6", e) == 0.01             # the puzzle's numbers, not 24
    assert score_puzzle24("8*5*10*6", _entry([8, 5, 10, 6])) == 0.01


def test_countdown_levels_follow_reasoning_gym_with_an_exact_check():
    e = _entry([6, 61, 94, 4], 309, "94*4 - 61 - 6")
    assert score_countdown("94*4 - 61 - 6", e) == 1.0
    assert score_countdown("6 + 61 + 94 + 4", e) == 0.05        # well formed, the numbers, not the target
    assert score_countdown("94*4 - 61", e) == 0.05              # a number missing
    assert score_countdown("94*0 + 61*0 + 6*0 + 4*0 + len('" + "a" * 309 + "')", e) == 0.01
    # exact rationals: 1/3*3 is 1, not 0.999...
    assert score_countdown("(1/3)*3*100", _entry([1, 3, 3, 100], 100)) == 1.0


def test_coin_flip_has_no_prefix_credit_and_agrees_with_reasoning_gym_on_exact_answers():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    ds = reasoning_gym.create_dataset("coin_flip", seed=3, size=40)
    prefix_paid = 0
    for i in range(40):
        e = ds[i]
        oracle = e["answer"]
        r = e["metadata"]["rational"]
        for honest in (oracle, f"{r['numerator']}/{r['denominator']}", f" {oracle} "):
            assert score_coin_flip(honest, e) == ds.score_answer(honest, e) == 1.0, (honest, oracle)
        # reasoning-gym pays a matching prefix of the decimal expansion ("0" against "0.0546875");
        # the project pays nothing for a wrong probability
        if oracle.startswith("0."):
            prefix_paid += ds.score_answer("0", e) > 0.5
        assert score_coin_flip("0", e) == (1.0 if float(oracle) == 0 else 0.0)
        assert score_coin_flip("0.", e) == score_coin_flip("1/0", e) == score_coin_flip("0.5e99999", e) == 0.0
    assert prefix_paid >= 30  # the control: the exploit is real on most questions


@pytest.mark.parametrize("ok", ["x**2/2 + C", "-cos(8*x - 8)**4/4 + C", "2*(5*x + 10)**(3/2) + C", "exp(x)*sin(x)/2",
                                "log(Abs(x)) + pi*x", "x**(-3)", "3**x/log(3)", "sqrt(x) + E", "1.5*x"])
def test_symbolic_gate_admits_antiderivatives(ok):
    check_symbolic(ok, frozenset({"x", "C"}))


@pytest.mark.parametrize("attack", [
    "Integral(x*cos(x), x) + C", "integrate(x*cos(x), x)", "diff(x, x)", "expand((x+1)*(x+2))", "Subs(x, x, 1)",
    "simplify(x)", "__import__('os').system('true')", "x.diff(x)", "entry['answer']", "metadata", "y", "S('x')",
    "lambda: 1", "[x]", "'x'", "x if 1 else 2", "x < 2", "f(x)", "sin(x, evaluate=False)", "sin(*[x])", "9**9**9",
    "x**65", "(10**64)**64", "2**(2**(2**(2**6)))", "1j*x", "True*x", "(" * 25 + "x" + ")" * 25, "-" * 4000 + "x",
    "x^2", "x!", "x" * 5000,
])
def test_symbolic_gate_refuses_code_and_blowups(attack):
    t0 = time.perf_counter()
    for _ in range(50):
        with pytest.raises(AnswerRefused):
            check_symbolic(attack, frozenset({"x", "C"}))
    assert time.perf_counter() - t0 < 2.0


def test_literal_gate():
    for ok in ("[[1, 0], [0, 1]]", "[1, 2, 3]", "['A', 'B']", "(1, -2)"):
        check_literal(ok)
    for bad in ("oracle_answer.split()", "[x for x in '123']", "entry['answer']", "list('ABC')", "[[[[1]]]]",
                "[1] * 3", "{'a': 1}", "[print(1)]"):
        with pytest.raises(AnswerRefused):
            check_literal(bad)
    e = {"answer": "CBBBDED", "metadata": {}}
    literal_or_text("CBBBDED", e)           # the reference text itself
    literal_or_text("1 0\n0 1", e)          # not Python: the scorer's eval raises, only its text match is left
    literal_or_text("['C', 'B']", e)
    with pytest.raises(AnswerRefused):
        literal_or_text("''.join(oracle_answer)", e)
