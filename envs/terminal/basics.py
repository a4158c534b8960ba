"""terminal-basics-v0: one-command shell tasks, the first rung of the terminal curriculum.

Same domain, sandbox, tools and rubric as terminal-v0 (envs/terminal/domain.py); only the task
families differ. Each task's directory holds a single data file, and the instruction says what to
compute from it (lines, words, first/last line, sorted lines, distinct lines); one command plus
`submit` solves it. The command does not need to name the file (`cat *`, `head -n 1 *`), so a model
a few million parameters large can learn the skill from a short supervised warm start and still
has room to improve under RL. Held-out tasks use file names and extensions (the variants) that no
train task of the same family uses, with fresh contents (envs/splits.py).

Why no task here asks to copy an argument from the instruction into the command: measured with the
tiny HybridMoe (3.4M parameters) on families like "write the word X to answer.txt", the model learns
the call format and one fixed command per family within 60 SFT steps but does not learn to copy an
unseen word even after 180 steps (held-out success 1-3%, greedy 0%: it always writes the same
word). Copying needs an induction mechanism that forms late in training; that rung belongs to a
bigger model or a longer run than a CPU test allows. (Byte-level BPE also gives " word" and "`word"
different token ids, so instructions keep arguments after a space.)

This module does not change terminal-v0: its 14 families and task sets are unchanged.
"""
from __future__ import annotations

import random
from itertools import product

from envs.terminal.families import WORDS, Family, Instance, _answer_is

# Word pool for file names and contents: terminal-v0's words plus more, lowercase ASCII (sort order
# is the same in Python and in `sort` under the sandbox's C.UTF-8 locale).
NAMES = WORDS + ("amber", "birch", "cobalt", "dune", "falcon", "garnet", "hazel", "indigo", "jasper", "koala",
                 "lotus", "maple", "nectar", "oasis", "pepper", "quill", "ridge", "saffron", "thistle", "violet",
                 "willow", "yarrow", "zinnia", "comet")
EXTS = ("txt", "log", "dat")
LEAD = "This directory holds a single file. "


def _text_lines(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(NAMES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


class _OneFile(Family):
    """A family over one data file named by the variant (stem, extension)."""

    ask: str
    command: str

    def variants(self):
        return list(product(NAMES, EXTS))

    def lines(self, rng: random.Random) -> list[str]:
        return _text_lines(rng, rng.randint(3, 30))

    def expected(self, lines: list[str]) -> list[str]:
        raise NotImplementedError

    def generate(self, rng, variant):
        stem, ext = variant
        lines = self.lines(rng)
        return Instance(instruction=LEAD + self.ask, files={f"{stem}.{ext}": ("\n".join(lines) + "\n").encode()},
                        reference=(self.command,), check={"expected": self.expected(lines)})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


class LineCount(_OneFile):
    name = "line_count"
    ask = "Write the number of lines in it to answer.txt."
    command = "cat * | wc -l > answer.txt"

    def expected(self, lines):
        return [str(len(lines))]


class WordCount(_OneFile):
    name = "word_count"
    ask = "Write the number of words in it to answer.txt."
    command = "cat * | wc -w > answer.txt"

    def expected(self, lines):
        return [str(sum(len(ln.split()) for ln in lines))]


class FirstLine(_OneFile):
    name = "first_line"
    ask = "Write its first line to answer.txt."
    command = "head -n 1 * > answer.txt"

    def expected(self, lines):
        return lines[:1]


class LastLine(_OneFile):
    name = "last_line"
    ask = "Write its last line to answer.txt."
    command = "tail -n 1 * > answer.txt"

    def expected(self, lines):
        return lines[-1:]


class SortedLines(_OneFile):
    name = "sorted_lines"
    ask = "Write its lines, sorted alphabetically, to answer.txt."
    command = "sort * > answer.txt"

    def expected(self, lines):
        return sorted(lines)


class DistinctLines(_OneFile):
    name = "distinct_lines"
    ask = "Write the number of distinct lines in it to answer.txt."
    command = "sort -u * | wc -l > answer.txt"

    def lines(self, rng):
        pool = _text_lines(rng, rng.randint(2, 8))
        return [rng.choice(pool) for _ in range(rng.randint(len(pool), 25))]  # repeats on purpose

    def expected(self, lines):
        return [str(len(set(lines)))]


BASIC_FAMILIES: dict[str, Family] = {f.name: f for f in (LineCount(), WordCount(), FirstLine(), LastLine(), SortedLines(),
                                                          DistinctLines())}
