"""Answer grading: normalisation, extraction, exact match, token F1 (vs a slow reference), length cap."""
from __future__ import annotations

import string

import pytest

from envs.browse.grading import MAX_ANSWER_CHARS, extract_answer, grade_answer, normalize_answer, token_cap, token_f1


def ref_normalize(s: str) -> str:
    """SQuAD v1.1's normalisation, written out step by step (plus accents and thousands separators)."""
    import unicodedata

    s = "".join(c for c in unicodedata.normalize("NFKD", s) if not unicodedata.combining(c)).lower()
    out = []
    for i, c in enumerate(s):  # drop a comma between digits when three digits follow it and then a non-digit
        if c == "," and 0 < i and s[i - 1].isdigit() and s[i + 1:i + 4].isdigit() and len(s[i + 1:i + 4]) == 3 and \
                (i + 4 >= len(s) or not s[i + 4].isalnum()):
            continue
        out.append(" " if (c in string.punctuation or (not c.isalnum() and not c.isspace())) else c)
    words = [w for w in "".join(out).split() if w not in ("a", "an", "the")]
    return " ".join(words)


def ref_f1(pred: str, gold: str) -> float:
    p, g = ref_normalize(pred).split(), ref_normalize(gold).split()
    if not p or not g:
        return float(p == g)
    # Count overlaps one token at a time, removing matched gold tokens (multiset intersection).
    remaining = list(g)
    same = 0
    for t in p:
        if t in remaining:
            remaining.remove(t)
            same += 1
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


CASES = ["The Glass River", "glass river!", "  Alder   Voss ", "Zürich-Ost", "887,715", "887715", "a 1,234 b",
         "Rivers of the North", "the the the", "Crimson Tower (novel, 1987)", "It's an A-team", "1, 2, 3"]


@pytest.mark.parametrize("s", CASES)
def test_normalize_matches_reference(s):
    assert normalize_answer(s) == ref_normalize(s)


@pytest.mark.parametrize("pred", CASES)
@pytest.mark.parametrize("gold", ["Glass River", "887,715", "Alder Voss", "Crimson Tower"])
def test_token_f1_matches_reference(pred, gold):
    assert token_f1(pred, gold) == pytest.approx(ref_f1(pred, gold))


def test_token_f1_known_values():
    assert token_f1("Glass River", "the glass river") == 1.0
    assert token_f1("Glass", "Glass River") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert token_f1("", "x") == 0.0


def test_extraction_takes_the_last_answer_line():
    assert extract_answer("I looked it up.\nAnswer: Tarsk") == "Tarsk"
    assert extract_answer("Final answer: \"1987\"") == "1987"
    assert extract_answer("answer: x\nExact answer: Brin Tal\n") == "Brin Tal"
    assert extract_answer("  Tarsk  ") == "Tarsk"


def test_exact_match_and_aliases():
    assert grade_answer("the Glass River.", "Glass River").em == 1.0
    assert grade_answer("Answer: 887715", "887,715").em == 1.0
    assert grade_answer("Wynnev Trust (brewing, 1829)", "Wynnev Trust", ("Wynnev Trust (brewing, 1829)",)).em == 1.0
    g = grade_answer("Glass", "Glass River")
    assert g.em == 0.0 and 0 < g.f1 < 1
    assert grade_answer(None, "x").em == 0.0
    with pytest.raises(ValueError, match="empty"):
        grade_answer("x", " the ")


def test_answer_stuffing_scores_zero():
    gold = "Alder Voss"
    cands = ["Brin Tal", "Alder Voss", "Orin Kell", "Tarsk"]
    stuffed = grade_answer(", ".join(cands), gold)
    assert stuffed.em == 0.0 and stuffed.f1 == 0.0 and stuffed.too_long
    # Two names with the gold one inside: within the cap, but not an exact match.
    two = grade_answer("Alder Voss or Brin Tal", gold)
    assert two.em == 0.0 and not two.too_long and two.f1 < 1
    # A long essay containing the answer does not count either.
    essay = "After much research I believe the answer is Alder Voss. " * 10
    assert len(essay) > MAX_ANSWER_CHARS and grade_answer(essay, gold).em == 0.0


def test_token_cap():
    assert token_cap("Tarsk") == 4 and token_cap("Alder Voss") == 5 and token_cap("The Crimson Tower Press") == 6
