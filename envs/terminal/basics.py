"""terminal-basics-v0: one-command shell tasks, the first rung of the terminal curriculum.

Same domain, sandbox, tools and rubric as terminal-v0 (envs/terminal/domain.py); only the task
families differ. Each task is solved by one short command plus `submit`, and the parameter the
command must carry (a word, a file name, a line count) appears verbatim in the instruction, so a
model a few million parameters large can learn the format by supervised warm start and still have
room to improve under RL. Held-out tasks use parameter values (words, file names, counts) that no
train task of the same family uses (envs/splits.py), so held-out success measures copying an unseen
argument into the right place, not recall of a memorised command.

This module does not add anything to terminal-v0: its 14 families and task sets are unchanged.
"""
from __future__ import annotations

import random
from itertools import product

from envs.terminal.families import WORDS, Family, Instance, _answer_is, _lines

# Word pool for parameters: terminal-v0's words plus more, all lowercase ASCII (no shell quoting).
NAMES = WORDS + ("amber", "birch", "cobalt", "dune", "falcon", "garnet", "hazel", "indigo", "jasper", "koala",
                 "lotus", "maple", "nectar", "oasis", "pepper", "quill", "ridge", "saffron", "thistle", "violet",
                 "willow", "yarrow", "zinnia", "comet")


def _text_lines(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(NAMES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


class EchoWord(Family):
    name = "echo_word"

    def variants(self):
        return [(w,) for w in NAMES]

    def generate(self, rng, variant):
        (word,) = variant
        return Instance(instruction=f"Write the word `{word}` to `answer.txt`.", files={},
                        reference=(f"echo {word} > answer.txt",), check={"expected": [word]})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


class CountLines(Family):
    name = "count_lines"

    def variants(self):
        return [(w,) for w in NAMES]

    def generate(self, rng, variant):
        (stem,) = variant
        n = rng.randint(2, 30)
        other = rng.choice([w for w in NAMES if w != stem])
        files = {f"{stem}.txt": ("\n".join(_text_lines(rng, n)) + "\n").encode(),
                 f"{other}.txt": ("\n".join(_text_lines(rng, rng.randint(2, 30))) + "\n").encode()}
        return Instance(instruction=f"Write the number of lines in `{stem}.txt` to `answer.txt`.", files=files,
                        reference=(f"wc -l < {stem}.txt > answer.txt",), check={"expected": [str(n)]})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


class HeadLines(Family):
    name = "head_lines"

    def variants(self):
        return list(product((1, 2, 3, 4, 5), NAMES[:10]))

    def generate(self, rng, variant):
        k, stem = variant
        lines = _text_lines(rng, rng.randint(k + 2, 20))
        return Instance(instruction=f"Write the first {k} lines of `{stem}.txt` to `answer.txt`.",
                        files={f"{stem}.txt": ("\n".join(lines) + "\n").encode()},
                        reference=(f"head -n {k} {stem}.txt > answer.txt",), check={"expected": lines[:k]})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


class CopyFile(Family):
    name = "copy_file"

    def variants(self):
        return [(a, b) for a, b in product(NAMES[:8], NAMES[8:16])]

    def generate(self, rng, variant):
        src, dst = variant
        lines = _text_lines(rng, rng.randint(2, 10))
        return Instance(instruction=f"Copy the file `{src}.txt` to `{dst}.txt`.",
                        files={f"{src}.txt": ("\n".join(lines) + "\n").encode()},
                        reference=(f"cp {src}.txt {dst}.txt",), check={"dst": f"{dst}.txt", "expected": lines})

    def check(self, g, data):
        return float(_lines(g.read_text(data["dst"])) == data["expected"])


BASIC_FAMILIES: dict[str, Family] = {f.name: f for f in (EchoWord(), CountLines(), HeadLines(), CopyFile())}
