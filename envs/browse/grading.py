"""Grading of browsing answers: one extracted answer, normalised exact match, length cap, token F1.

The reward is exact match (EM) of the normalised extracted answer against the gold answer or an
alias. Normalisation follows the SQuAD v1.1 evaluation script (Rajpurkar et al., 2016): lower case,
strip punctuation and the articles a/an/the, collapse whitespace; we also fold accents and drop
thousands separators ("12,345" == "12345"). Token F1 is the SQuAD token-overlap F1 (harmonic mean of
token precision and recall on normalised tokens), reported as a metric only.

Extraction: if the text contains a line like ``Answer: X`` / ``Final answer: X``, X is the answer;
otherwise the whole text. Answer stuffing is refused: an extracted answer longer than
``max(2 * gold_tokens, gold_tokens + 3)`` tokens or `MAX_ANSWER_CHARS` characters scores 0 and its F1
counts as 0 (`too_long` = 1), so listing every candidate cannot win EM and cannot farm F1 either.
Grading reads only the task's private record and the answer text, never page content, which is
why prompt-injected pages cannot change a grade.
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

MAX_ANSWER_CHARS = 200
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+answer|exact\s+answer|answer)\s*[:：]\s*(.+?)\s*$", re.I | re.M)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_PUNCT = re.compile(r"[^\w\s]|_")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation plus accent folding and thousands separators."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = _THOUSANDS.sub("", text)
    text = _PUNCT.sub(" ", text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def extract_answer(text: str) -> str:
    """The one answer in a reply: the last ``Answer: X`` line if there is one, else the stripped text."""
    hits = _ANSWER_LINE.findall(text)
    return (hits[-1] if hits else text).strip().strip("\"'`*").strip()


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between two normalised strings' tokens (0 when either side is empty)."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def token_cap(gold: str) -> int:
    n = max(1, len(normalize_answer(gold).split()))
    return max(2 * n, n + 3)


@dataclass(frozen=True)
class AnswerGrade:
    em: float
    f1: float
    too_long: bool
    extracted: str


def grade_answer(answer_text: str | None, gold: str, aliases: tuple[str, ...] | list[str] = ()) -> AnswerGrade:
    """EM / F1 of one reply against the gold answer and its aliases (best alias wins)."""
    if not gold or not normalize_answer(gold):
        raise ValueError(f"gold answer {gold!r} is empty after normalisation")
    if answer_text is None:
        return AnswerGrade(0.0, 0.0, False, "")
    extracted = extract_answer(answer_text)
    golds = [gold, *aliases]
    toks = normalize_answer(extracted).split()
    if len(extracted) > MAX_ANSWER_CHARS or len(toks) > max(token_cap(g) for g in golds):
        return AnswerGrade(0.0, 0.0, True, extracted[:MAX_ANSWER_CHARS])
    norm = normalize_answer(extracted)
    em = float(any(norm == normalize_answer(g) for g in golds))
    f1 = max(token_f1(extracted, g) for g in golds)
    return AnswerGrade(em, f1, False, extracted)
