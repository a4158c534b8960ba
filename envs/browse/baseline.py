"""The no-browsing baseline of a question set: answer each field's most common train answer, read nothing.

A policy that never opens a page can still see which field a question asks for (its phrase, "What is
the continent of ..."; the recorded `answer_field` label stands for it) and learn, from training
rewards, the answer that field most often has. `fixed_answer_baseline` measures what that prior is
worth: for every field, the most common normalised train answer, scored with the real grader
(`grading.grade_answer`, aliases included) on the train questions (in-sample: what RL could learn to
exploit) and on the held-out questions. `synth.MAX_ANSWER_SHARE` keeps this small for the generated
corpus; `python -m envs.browse.baseline [--pages N]` prints the table for a built corpus.

This module measures only; it does not change questions and is not used in grading.
"""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from envs.browse.corpus import Question
from envs.browse.grading import grade_answer, normalize_answer


@dataclass(frozen=True)
class FieldBaseline:
    field: str
    answer: str  # the field's most common train answer (normalised)
    n_train: int
    hits_train: int
    n_heldout: int
    hits_heldout: int

    @property
    def train_rate(self) -> float:
        return self.hits_train / self.n_train if self.n_train else 0.0

    @property
    def heldout_rate(self) -> float:
        return self.hits_heldout / self.n_heldout if self.n_heldout else 0.0


@dataclass(frozen=True)
class Baseline:
    fields: tuple[FieldBaseline, ...]  # by in-sample train rate, highest first

    @property
    def train_rate(self) -> float:
        n = sum(f.n_train for f in self.fields)
        return sum(f.hits_train for f in self.fields) / n if n else 0.0

    @property
    def heldout_rate(self) -> float:
        n = sum(f.n_heldout for f in self.fields)
        return sum(f.hits_heldout for f in self.fields) / n if n else 0.0

    def table(self) -> str:
        rows = [f"{'field':<14} {'train n':>7} {'train EM':>8} {'held-out n':>10} {'held-out EM':>11}  best fixed answer"]
        for f in self.fields:
            rows.append(f"{f.field:<14} {f.n_train:>7} {f.train_rate:>8.3f} {f.n_heldout:>10} {f.heldout_rate:>11.3f}  {f.answer!r}")
        rows.append(f"{'all':<14} {sum(f.n_train for f in self.fields):>7} {self.train_rate:>8.3f} "
                    f"{sum(f.n_heldout for f in self.fields):>10} {self.heldout_rate:>11.3f}")
        return "\n".join(rows)


def _hits(answer: str, qs: Sequence[Question]) -> int:
    return int(sum(grade_answer(answer, q.answer, q.aliases).em for q in qs))


def fixed_answer_baseline(questions: Sequence[Question]) -> Baseline:
    """Per field (`Question.answer_field`): the most common normalised train answer, and how often it is right."""
    train = [q for q in questions if q.split == "train"]
    heldout = [q for q in questions if q.split != "train"]
    out = []
    for field in sorted({q.answer_field for q in questions}):
        tr = [q for q in train if q.answer_field == field]
        he = [q for q in heldout if q.answer_field == field]
        counts = Counter(normalize_answer(q.answer) for q in tr)
        best = counts.most_common(1)[0][0] if counts else ""
        out.append(FieldBaseline(field, best, len(tr), _hits(best, tr) if best else 0, len(he), _hits(best, he) if best else 0))
    return Baseline(tuple(sorted(out, key=lambda f: (-f.train_rate, f.field))))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=10_000, help="entity pages of the generated corpus (browse-v0: 10000)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from envs.browse.synth import generate

    print(fixed_answer_baseline(generate(args.pages, args.seed).questions).table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
