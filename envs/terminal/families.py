"""The terminal-v0 task families: procedurally generated shell tasks in the spirit of Terminal-Bench.

Each family has
- `variants()`: a finite list of *structural* parameters (which word, which column, which
  compression...). The held-out split draws only variants the train split never uses (see
  tasks.py), so held-out measures generalisation to unseen parameters, not unseen random files;
- `generate(rng, variant) -> Instance`: the instruction, the set-up files (and trusted set-up
  commands, e.g. building a git history), a reference solution as bash commands, and the private
  data the check needs (expected answers, hidden test inputs);
- `check(grader, data) -> float in [0, 1]`: the final-state check, reading the agent's files as
  data through `Grader` (grader.py) or running trusted programs in a fresh sandbox.

Expected answers are computed here in Python from the generated data, independently of the
shell reference solution; tests run the reference through the sandbox and require score 1, so
each family's instruction, reference and check are checked against each other.
"""
from __future__ import annotations

import abc
import bz2
import calendar
import csv
import io
import json
import lzma
import random
import re
import shlex
import sqlite3
import string
import tarfile
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, ClassVar

from envs.terminal.grader import Grader

WORDS = ("alpha", "bravo", "cargo", "delta", "ember", "fable", "glyph", "harbor", "ivory", "jolly", "kernel",
         "lemon", "mango", "nylon", "orbit", "pixel", "quartz", "raven", "sable", "tango", "umbra", "vivid",
         "walnut", "xenon", "yonder", "zephyr")


@dataclass(frozen=True)
class Instance:
    instruction: str
    files: dict[str, bytes]
    reference: tuple[str, ...]
    check: dict[str, Any]
    modes: dict[str, int] = field(default_factory=dict)  # path -> mode (default 0o644)
    setup: tuple[str, ...] = ()  # trusted commands run in the sandbox before the episode


class Family(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def variants(self) -> list[tuple]: ...

    @abc.abstractmethod
    def generate(self, rng: random.Random, variant: tuple) -> Instance: ...

    @abc.abstractmethod
    def check(self, g: Grader, data: dict[str, Any]) -> float: ...


def _lines(text: str | None) -> list[str] | None:
    """Answer-file normalisation: trailing whitespace per line and trailing blank lines do not matter."""
    if text is None:
        return None
    out = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while out and not out[-1]:
        out.pop()
    return out


def _answer_is(g: Grader, expected: list[str], path: str = "answer.txt") -> float:
    return float(_lines(g.read_text(path)) == expected)


def _sentence(rng: random.Random, n: int, avoid: str | None = None) -> str:
    words = [w for w in WORDS if w != avoid]
    return " ".join(rng.choice(words) for _ in range(n))


# ----------------------------------------------------------------------------- 1. grep
class GrepCount(Family):
    name = "grep_count"

    def variants(self):
        return list(product(WORDS[:13], ("log", "txt")))

    def generate(self, rng, variant):
        word, ext = variant
        files: dict[str, bytes] = {}
        count = 0
        dirs = ["logs", "logs/app", "logs/app/old", "logs/web"]
        for i in range(rng.randint(4, 6)):
            lines = []
            for _ in range(rng.randint(15, 40)):
                r = rng.random()
                if r < 0.25:
                    line = f"{_sentence(rng, 3, word)} {word} {_sentence(rng, 2, word)}"
                elif r < 0.35:  # case matters: these do not count
                    line = f"{_sentence(rng, 2, word)} {word.upper()} {_sentence(rng, 2, word)}"
                else:
                    line = _sentence(rng, 5, word)
                lines.append(line)
            files[f"{rng.choice(dirs)}/part{i}.{ext}"] = ("\n".join(lines) + "\n").encode()
            count += sum(word in ln for ln in lines)
        decoy_ext = "bak" if ext == "log" else "old"
        files[f"logs/extra.{decoy_ext}"] = f"{word} {word}\n{word}\n".encode()
        return Instance(
            instruction=(f"Count the lines that contain the word `{word}` (case-sensitive substring match) in all files "
                         f"whose name ends in `.{ext}` anywhere under `logs/`, including subdirectories. Write just the "
                         f"number to `answer.txt`."),
            files=files,
            reference=(f"find logs -type f -name '*.{ext}' -exec cat {{}} + | grep -c -- {shlex.quote(word)} > answer.txt",),
            check={"expected": [str(count)]})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


# ----------------------------------------------------------------------------- 2. find
class FindLarge(Family):
    name = "find_large"

    def variants(self):
        return list(product(("txt", "csv", "dat", "md", "json"), (100, 200, 500, 1000)))

    def generate(self, rng, variant):
        ext, threshold = variant
        files: dict[str, bytes] = {}
        exts = ["txt", "csv", "dat", "md", "json"]
        dirs = ["data", "data/raw", "data/raw/2024", "data/out", "data/tmp"]
        for i in range(rng.randint(14, 22)):
            e = ext if i < 6 else rng.choice(exts)
            # i == 0 is one byte over the threshold, i == 1 exactly at it (not "greater than").
            size = {0: threshold + 1, 1: threshold}.get(i, rng.randint(1, 3 * threshold))
            name = f"{rng.choice(dirs)}/{rng.choice(WORDS)}{i}.{e}"
            files[name] = "".join(rng.choice(string.ascii_lowercase) for _ in range(size)).encode()
        expected = sorted(p for p, b in files.items() if p.endswith("." + ext) and len(b) > threshold)
        return Instance(
            instruction=(f"List every file under `data/` whose name ends in `.{ext}` and whose size is strictly greater "
                         f"than {threshold} bytes. Write their paths relative to the current directory (like "
                         f"`data/raw/x.{ext}`), sorted in byte order, one per line, to `answer.txt`."),
            files=files,
            reference=(f"find data -type f -name '*.{ext}' -size +{threshold}c | LC_ALL=C sort > answer.txt",),
            check={"expected": expected})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


# ----------------------------------------------------------------------------- 3. sed
class SedConfig(Family):
    name = "sed_config"
    KEYS = ("port", "host", "timeout", "workers", "log_level", "cache_size", "retries", "user")

    def variants(self):
        return list(product(self.KEYS, ("ini", "env")))

    def generate(self, rng, variant):
        key, fmt = variant
        k = key.upper() if fmt == "env" else key
        sep = "=" if fmt == "env" else " = "
        new = f"{rng.choice(WORDS)}{rng.randint(10, 99)}"
        others = [x for x in self.KEYS if x != key]
        lines = ["# application settings", f"# {k}{sep}commented_out"]
        for section in ("main", "backup"):
            if fmt == "ini":
                lines.append(f"[{section}]")
            for o in rng.sample(others, 3):
                lines.append(f"{o.upper() if fmt == 'env' else o}{sep}{rng.choice(WORDS)}")
            lines.append(f"{k}{sep}{rng.choice(WORDS)}{rng.randint(1, 9)}")
            lines.append(f"{k}_backup{sep}{rng.choice(WORDS)}")
        original = "\n".join(lines) + "\n"
        pat = re.compile(rf"^({re.escape(k)}\s*=\s*).*$")
        expected = [pat.sub(lambda m: m.group(1) + new, ln) for ln in lines]
        return Instance(
            instruction=(f"In `config/app.conf`, set the value of the setting `{k}` to `{new}` on every line that sets it "
                         f"(lines of the form `{k}{sep}<value>`). Do not change comment lines (starting with `#`) or any "
                         f"other line."),
            files={"config/app.conf": original.encode()},
            reference=(f"sed -i -E 's/^({k}[[:space:]]*=[[:space:]]*).*$/\\1{new}/' config/app.conf",),
            check={"expected": expected})

    def check(self, g, data):
        return _answer_is(g, data["expected"], "config/app.conf")


# ----------------------------------------------------------------------------- 4. sort | uniq
class WordFreq(Family):
    name = "word_freq"

    def variants(self):
        return list(product((3, 4, 5), (True, False), ("words.txt", "corpus.txt", "text.txt", "notes.txt")))

    def generate(self, rng, variant):
        k, fold, fname = variant
        vocab = rng.sample(WORDS, 10)
        tokens = []
        for i, w in enumerate(vocab):
            tokens += [w] * (12 - i + rng.randint(0, 1))
        rng.shuffle(tokens)
        if fold:
            tokens = [t.capitalize() if rng.random() < 0.3 else t for t in tokens]
        lines, i = [], 0
        while i < len(tokens):
            n = rng.randint(3, 9)
            lines.append((" " * rng.randint(1, 2)).join(tokens[i:i + n]))
            i += n
        counts = Counter(t.lower() if fold else t for t in tokens)
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        lower = " | tr 'A-Z' 'a-z'" if fold else ""
        return Instance(
            instruction=(f"Find the {k} most frequent words in `{fname}` (words are separated by whitespace"
                         + ("; treat upper- and lower-case letters as the same word and report words in lower case" if fold else
                            "; case matters")
                         + f"). Write them to `answer.txt`, one per line as `<count> <word>`, most frequent first, ties "
                         f"broken by the word in byte order."),
            files={fname: ("\n".join(lines) + "\n").encode()},
            reference=(f"tr -s '[:space:]' '\\n' < {fname}{lower} | grep -v '^$' | LC_ALL=C sort | uniq -c | "
                       f"LC_ALL=C sort -k1,1nr -k2,2 | head -n {k} | awk '{{print $1, $2}}' > answer.txt",),
            check={"expected": [f"{c} {w}" for w, c in top]})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


# ----------------------------------------------------------------------------- 5. awk
class AwkAggregate(Family):
    name = "awk_aggregate"
    FILTERS = {"region": ("north", "south", "east", "west"), "team": ("red", "blue", "green"),
               "status": ("open", "closed", "held")}

    def variants(self):
        return list(product(self.FILTERS, ("amount", "hours", "score"), ("sum", "max")))

    def generate(self, rng, variant):
        filt, agg, op = variant
        cols = ["id", "region", "team", "status", "amount", "hours", "score"]
        rng.shuffle(cols)
        rows = []
        for i in range(rng.randint(25, 45)):
            r = {"id": f"r{i:03d}", "amount": rng.randint(1, 900), "hours": rng.randint(1, 60), "score": rng.randint(0, 100)}
            for f, vals in self.FILTERS.items():
                r[f] = rng.choice(vals)
            rows.append(r)
        val = rows[0][filt]
        picked = [r[agg] for r in rows if r[filt] == val]
        expected = sum(picked) if op == "sum" else max(picked)
        text = "\n".join([" ".join(cols)] + [" ".join(str(r[c]) for c in cols) for r in rows]) + "\n"
        body = "s += $h[a]} END {print s" if op == "sum" else "if (!n || $h[a] > m) {m = $h[a]; n = 1}} END {print m"
        ref = (f"awk -v f={filt} -v a={agg} -v v={val} 'NR == 1 {{for (i = 1; i <= NF; i++) h[$i] = i; next}} "
               f"$h[f] == v {{{body}}}' table.txt > answer.txt")
        return Instance(
            instruction=(f"`table.txt` is a whitespace-separated table whose first row names the columns. Compute the "
                         f"{'sum' if op == 'sum' else 'maximum'} of column `{agg}` over the rows whose `{filt}` is `{val}`, "
                         f"and write the number to `answer.txt`."),
            files={"table.txt": text.encode()},
            reference=(ref,),
            check={"expected": [str(expected)]})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


# ----------------------------------------------------------------------------- 6. JSON
class JsonFilter(Family):
    name = "json_filter"

    def variants(self):
        return list(product(("age", "score", "visits"), (">", ">="), ("name", "email")))

    def generate(self, rng, variant):
        key, cmp, out = variant
        users = []
        for i, first in enumerate(rng.sample(WORDS, 18)):
            users.append({"name": f"{first}_{i}", "email": f"{first}{i}@example.org", "age": rng.randint(18, 70),
                          "score": rng.randint(0, 100), "visits": rng.randint(0, 50), "active": rng.random() < 0.65})
        # At least one record passes even with `>`: otherwise the right answer could be an empty
        # file, and writing nothing would score. The record with the largest value is made active
        # and strictly above the threshold.
        top = max(users[1:], key=lambda u: u[key])
        top["active"] = True
        if top[key] <= users[0][key]:
            users[0][key], top[key] = top[key], users[0][key]
            if top[key] == users[0][key]:
                top[key] += 1
        thr = users[0][key]  # a value that occurs, so > and >= differ
        users[0]["active"] = True

        def keep(u):
            return u["active"] and (u[key] > thr if cmp == ">" else u[key] >= thr)

        expected = sorted(u[out] for u in users if keep(u))
        script = (f"import json; us = json.load(open('users.json')); "
                  f"print('\\n'.join(sorted(u['{out}'] for u in us if u['active'] and u['{key}'] {cmp} {thr})))")
        return Instance(
            instruction=(f"`users.json` holds a list of user records. Write the `{out}` of every user whose `active` is "
                         f"true and whose `{key}` is {cmp} {thr}, sorted in byte order, one per line, to `answer.txt`."),
            files={"users.json": json.dumps(users, indent=rng.choice([None, 2])).encode()},
            reference=(f"python3 -c {shlex.quote(script)} > answer.txt",),
            check={"expected": expected})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


# ----------------------------------------------------------------------------- 7. CSV
class CsvGroupBy(Family):
    name = "csv_groupby"
    PRODUCTS = ("Widget, large", "Widget, small", "Gadget", "Doohickey \"pro\"", "Sprocket")

    def variants(self):
        return list(product(("region", "product", "channel"), ("amount", "units"), ("summary.csv", "totals.csv")))

    def generate(self, rng, variant):
        group, value, out = variant
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["date", "region", "product", "channel", "amount", "units"])
        totals: Counter = Counter()
        for _ in range(rng.randint(20, 40)):
            row = {"date": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                   "region": rng.choice(("north", "south", "east")), "product": rng.choice(self.PRODUCTS),
                   "channel": rng.choice(("web", "store", "phone")), "amount": rng.randint(5, 500), "units": rng.randint(1, 20)}
            w.writerow([row[c] for c in ("date", "region", "product", "channel", "amount", "units")])
            totals[row[group]] += row[value]
        expected = [[group, "total"]] + [[k, str(totals[k])] for k in sorted(totals)]
        script = (f"import csv, collections; t = collections.Counter(); "
                  f"[t.update({{r['{group}']: int(r['{value}'])}}) for r in csv.DictReader(open('sales.csv', newline=''))]; "
                  f"w = csv.writer(open('{out}', 'w', newline=''), lineterminator='\\n'); w.writerow(['{group}', 'total']); "
                  f"[w.writerow([k, t[k]]) for k in sorted(t)]")
        return Instance(
            instruction=(f"`sales.csv` is a CSV file with a header row (fields may be quoted and contain commas). Write "
                         f"`{out}`: a CSV file with the header `{group},total` and one row per distinct `{group}` holding "
                         f"the sum of `{value}` for that {group}, rows sorted by `{group}` in byte order."),
            files={"sales.csv": buf.getvalue().encode()},
            reference=(f"python3 -c {shlex.quote(script)}",),
            check={"expected": expected, "path": out})

    def check(self, g, data):
        text = g.read_text(data["path"])
        if text is None:
            return 0.0
        try:
            rows = [r for r in csv.reader(io.StringIO(text)) if r]
        except csv.Error:
            return 0.0
        return float(rows == data["expected"])


# ----------------------------------------------------------------------------- 8. archives
_TAR_FLAGS = {"gz": ("z", ".tar.gz"), "bz2": ("j", ".tar.bz2"), "xz": ("J", ".tar.xz"), "none": ("", ".tar")}
_MAX_UNPACKED = 16 << 20


def _decompress_capped(data: bytes, cap: int = _MAX_UNPACKED) -> bytes | None:
    """Decompress an archive the agent made without trusting its size (a bomb returns None)."""
    if data[:2] == b"\x1f\x8b":
        d: Any = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif data[:3] == b"BZh":
        d = bz2.BZ2Decompressor()
    elif data[:6] == b"\xfd7zXZ\x00":
        d = lzma.LZMADecompressor()
    else:
        return data if len(data) <= cap else None
    try:
        out = d.decompress(data, cap + 1)
    except (OSError, EOFError, zlib.error, lzma.LZMAError, ValueError):
        return None
    return out if len(out) <= cap else None


class TarCreate(Family):
    name = "tar_create"

    def variants(self):
        return list(product(("txt", "md", "csv", "log"), tuple(_TAR_FLAGS)))

    def generate(self, rng, variant):
        ext, comp = variant
        flag, suffix = _TAR_FLAGS[comp]
        name = f"{rng.choice(('backup', 'bundle', 'docs'))}{suffix}"
        files: dict[str, bytes] = {}
        for i in range(rng.randint(8, 14)):
            e = ext if i < 3 else rng.choice(("txt", "md", "csv", "log", "bin"))
            path = f"{rng.choice(('docs', 'docs/a', 'docs/a/b', 'docs/c'))}/{rng.choice(WORDS)}{i}.{e}"
            files[path] = (_sentence(rng, rng.randint(3, 30)) + "\n").encode()
        files[f"other/{rng.choice(WORDS)}.{ext}"] = b"not under docs\n"
        expected = {p: files[p].decode() for p in files if p.startswith("docs/") and p.endswith("." + ext)}
        return Instance(
            instruction=(f"Create the archive `{name}` containing every file under `docs/` whose name ends in `.{ext}`, "
                         f"stored with its path (e.g. `docs/a/x.{ext}`), and no other files (directory entries are fine)."
                         + ("" if comp == "none" else f" Use {comp} compression.")),
            files=files,
            reference=(f"find docs -type f -name '*.{ext}' | tar -c{flag}f {name} -T -",),
            check={"archive": name, "compression": comp, "expected": expected})

    def check(self, g, data):
        raw = g.read(data["archive"], max_bytes=8 << 20)
        if raw is None:
            return 0.0
        magic = {"gz": b"\x1f\x8b", "bz2": b"BZh", "xz": b"\xfd7zXZ\x00"}.get(data["compression"])
        if magic and not raw.startswith(magic):
            return 0.0
        tar_bytes = _decompress_capped(raw)
        if tar_bytes is None:
            return 0.0
        try:
            with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tf:
                got: dict[str, str] = {}
                for m in tf.getmembers():
                    name = m.name[2:] if m.name.startswith("./") else m.name
                    if m.isdir():
                        continue
                    if not m.isfile() or m.size > (1 << 20):
                        return 0.0  # links / devices / oversize members do not belong in this archive
                    f = tf.extractfile(m)  # read into memory as data; nothing is written to disk
                    got[name] = f.read().decode("utf-8", "replace") if f else ""
        except (tarfile.TarError, OSError, EOFError):
            return 0.0
        return float(got == data["expected"])


# ----------------------------------------------------------------------------- 9. permissions
class Permissions(Family):
    name = "permissions"

    def variants(self):
        return list(product(("bin", "scripts", "tools"), ("secrets", "keys", "private"), (0o755, 0o750, 0o700)))

    def generate(self, rng, variant):
        bindir, secdir, mode = variant
        files: dict[str, bytes] = {}
        for i in range(rng.randint(2, 4)):
            files[f"{bindir}/{rng.choice(WORDS)}{i}.sh"] = b"#!/bin/sh\necho hello\n"
        files[f"{bindir}/README.txt"] = b"not a script\n"
        for i in range(rng.randint(2, 3)):
            files[f"{secdir}/{rng.choice(WORDS)}{i}.key"] = f"{rng.getrandbits(64):016x}\n".encode()
        files["notes.txt"] = b"leave me alone\n"
        expected = {}
        for p in files:
            if p.startswith(bindir + "/") and p.endswith(".sh"):
                expected[p] = mode
            elif p.startswith(secdir + "/"):
                expected[p] = 0o600
            else:
                expected[p] = 0o644
        return Instance(
            instruction=(f"Set the permission mode of every `.sh` file in `{bindir}/` to {mode:o}, and of every file in "
                         f"`{secdir}/` to 600. All other files must keep their current mode (644)."),
            files=files,
            modes={p: 0o644 for p in files},
            reference=(f"chmod {mode:o} {bindir}/*.sh && chmod 600 {secdir}/*",),
            check={"expected": {p: m for p, m in expected.items()}})

    def check(self, g, data):
        # Host-side lstat of each file (Sandbox.stat_artifact): nothing runs in the agent's sandbox,
        # and a symlink (even to a file with the right mode) or a missing file fails the task.
        for path, want in data["expected"].items():
            st = g.stat(path)
            if st is None or st.kind != "file" or st.mode != want:
                return 0.0
        return 1.0


# ----------------------------------------------------------------------------- 10. a shell script
class ShellScript(Family):
    name = "shell_script"
    SCRIPT_TIMEOUT_S = 5.0  # per hidden input, in the grading sandbox

    def variants(self):
        return list(product((1, 2, 3, 4), ("gt", "lt"), (",", ":", ";")))

    @staticmethod
    def _rows(rng: random.Random, sep: str, n: int) -> list[str]:
        return [sep.join(str(rng.randint(0, 99)) if j != 0 or rng.random() < 0.5 else rng.choice(WORDS)
                         for j in range(4)) for _ in range(n)]

    def generate(self, rng, variant):
        k, op, sep = variant
        thr = rng.randint(30, 70)
        sample = self._rows(rng, sep, 8)

        def keep(line: str) -> bool:
            f = line.split(sep)[k - 1]
            if not f.isdigit():
                return False
            return int(f) > thr if op == "gt" else int(f) < thr

        hidden = []
        while len(hidden) < 2:
            rows = self._rows(rng, sep, rng.randint(10, 20))
            if not 0 < sum(map(keep, rows)) < len(rows):  # an empty or full answer would test nothing
                continue
            hidden.append({"input": "\n".join(rows) + "\n", "expected": [r for r in rows if keep(r)]})
        word = "greater" if op == "gt" else "less"
        awk_op = ">" if op == "gt" else "<"
        ref = (f"cat > filter.sh <<'EOF'\n#!/bin/bash\nawk -F'{sep}' '${k} ~ /^[0-9]+$/ && ${k} {awk_op} {thr}' \"$1\"\nEOF\n"
               f"chmod +x filter.sh")
        return Instance(
            instruction=(f"Write a bash script `filter.sh` that takes one argument, a file path, and prints to stdout, in "
                         f"their original order, exactly the lines of that file whose field {k} (fields are separated by "
                         f"`{sep}`, counting from 1) is a non-negative integer {word} than {thr}. `sample.txt` is an "
                         f"example input. The grader runs `bash filter.sh <file>` on inputs you have not seen."),
            files={"sample.txt": ("\n".join(sample) + "\n").encode()},
            reference=(ref,),
            check={"tests": hidden})

    def check(self, g, data):
        script = g.read("filter.sh", max_bytes=64 << 10)
        if script is None:
            return 0.0
        files = {"filter.sh": script}
        for i, t in enumerate(data["tests"]):
            files[f"in{i}.txt"] = t["input"].encode()
        # A filter over 20 lines takes milliseconds; the cap bounds what a looping script costs the grader.
        results = g.run_fresh(files, [["/bin/bash", "filter.sh", f"in{i}.txt"] for i in range(len(data["tests"]))],
                              timeout_s=self.SCRIPT_TIMEOUT_S)
        for r, t in zip(results, data["tests"]):
            if r.timed_out or _lines(r.stdout) != t["expected"]:
                return 0.0
        return 1.0


# ----------------------------------------------------------------------------- 11. git repair
class GitRescue(Family):
    name = "git_rescue"

    def variants(self):
        return list(product(("rescue", "recovered", "saved", "restore"), ("notes.txt", "plan.md", "todo.txt")))

    def generate(self, rng, variant):
        branch, fname = variant
        main_msgs = [f"{v} {rng.choice(WORDS)}" for v in ("add", "update", "tidy")]
        lost_msg = f"WIP {rng.choice(WORDS)} {rng.randint(100, 999)}"
        lost_line = _sentence(rng, 4)
        q = shlex.quote
        setup = ["git init -q -b main repo",
                 "cd repo && git config user.email dev@example.org && git config user.name dev"]
        for i, msg in enumerate(main_msgs):
            setup.append(f"cd repo && echo {q(_sentence(rng, 3))} >> {fname} && git add {fname} && git commit -qm {q(msg)}")
        setup.append(f"cd repo && git checkout -q --detach && echo {q(lost_line)} >> {fname} && "
                     f"git commit -qam {q(lost_msg)} && git checkout -q main")
        ref = (f"cd repo && git branch {branch} \"$(git log -g --format='%H %s' HEAD | grep -F -- {q(lost_msg)} | "
               f"head -n 1 | cut -d' ' -f1)\"")
        return Instance(
            instruction=(f"In the git repository `repo/`, a commit with the message `{lost_msg}` was made on a detached "
                         f"HEAD and is no longer on any branch. Create a branch named `{branch}` that points at that "
                         f"commit. Do not change `main`."),
            files={},
            setup=tuple(setup),
            reference=(ref,),
            check={"branch": branch, "file": fname, "lost_msg": lost_msg, "lost_line": lost_line,
                   "main_subjects": list(reversed(main_msgs))})

    GIT = ["/usr/bin/git", "-c", "safe.directory=*", "--git-dir=repo.git"]

    def check(self, g, data):
        # Copy only the object database and refs, as data; the agent's .git/config and hooks
        # (which can make git run commands) are replaced by a trusted minimal config.
        files: dict[str, bytes] = {"repo.git/config": b"[core]\n\trepositoryformatversion = 0\n\tbare = true\n"}
        for p in g.files():
            rel = p[len("repo/.git/"):] if p.startswith("repo/.git/") else None
            if rel and (rel in ("HEAD", "packed-refs") or rel.startswith(("objects/", "refs/"))):
                data_ = g.read(p, max_bytes=4 << 20)
                if data_ is not None:
                    files["repo.git/" + rel] = data_
        if "repo.git/HEAD" not in files:
            return 0.0
        b = data["branch"]
        # git needs refs/ and objects/ to exist even when every ref is packed.
        res = g.run_fresh(files, [["/bin/mkdir", "-p", "repo.git/refs", "repo.git/objects"], self.GIT + ["log", "-1", "--format=%s", b, "--"],
                                  self.GIT + ["show", f"{b}:{data['file']}"],
                                  self.GIT + ["log", "--format=%s", "main", "--"]])
        _, subject, content, main_log = res
        return float(subject.exit_code == 0 and subject.stdout.strip() == data["lost_msg"]
                     and content.exit_code == 0 and data["lost_line"] in content.stdout
                     and main_log.exit_code == 0 and _lines(main_log.stdout) == data["main_subjects"])


# ----------------------------------------------------------------------------- 12. sqlite
class SqliteQuery(Family):
    name = "sqlite_query"

    def variants(self):
        return list(product(("top_customer", "city_year_total", "count_over"), ("orders", "purchases"), ("amount", "total")))

    def generate(self, rng, variant):
        kind, table, col = variant
        cities = ("Oslo", "Lima", "Pune", "Kyiv", "Perth")
        customers = [(i + 1, f"{w.capitalize()} {rng.choice(WORDS).capitalize()}", rng.choice(cities))
                     for i, w in enumerate(rng.sample(WORDS, 10))]
        orders = [(i + 1, rng.randint(1, 10), rng.randint(5, 400), rng.choice((2022, 2023, 2024))) for i in range(60)]
        totals = Counter()
        for _, c, a, _ in orders:
            totals[c] += a
        best = max(totals, key=lambda c: (totals[c], -c))
        orders.append((61, best, 1000, 2024))  # a unique maximum
        totals[best] += 1000
        if kind == "top_customer":
            question = f"the name of the customer whose {table} have the largest total `{col}` (over all years)"
            sql = (f"SELECT c.name FROM customers c JOIN {table} o ON o.customer_id = c.id GROUP BY c.id "
                   f"ORDER BY SUM(o.{col}) DESC LIMIT 1;")
            answer = next(n for i, n, _ in customers if i == best)
        elif kind == "city_year_total":
            city, year = customers[0][2], rng.choice((2022, 2023, 2024))
            question = f"the total `{col}` of all {table} made in {year} by customers living in {city}"
            sql = (f"SELECT COALESCE(SUM(o.{col}), 0) FROM {table} o JOIN customers c ON o.customer_id = c.id "
                   f"WHERE c.city = '{city}' AND o.year = {year};")
            in_city = {i for i, _, ct in customers if ct == city}
            answer = str(sum(a for _, c, a, y in orders if c in in_city and y == year))
        else:
            x = rng.randint(100, 300)
            question = f"the number of {table} whose `{col}` is greater than {x}"
            sql = f"SELECT COUNT(*) FROM {table} WHERE {col} > {x};"
            answer = str(sum(a > x for _, _, a, _ in orders))
        with tempfile.TemporaryDirectory() as d:
            db = Path(d) / "shop.db"
            con = sqlite3.connect(db)
            con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT)")
            con.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, customer_id INTEGER, {col} INTEGER, year INTEGER)")
            con.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
            con.executemany(f"INSERT INTO {table} VALUES (?, ?, ?, ?)", orders)
            con.commit()
            con.close()
            blob = db.read_bytes()
        py = f"import sqlite3; print(sqlite3.connect('shop.db').execute({sql!r}).fetchone()[0])"
        ref = (f"if command -v sqlite3 >/dev/null; then sqlite3 shop.db {shlex.quote(sql)}; "
               f"else python3 -c {shlex.quote(py)}; fi > answer.txt")
        return Instance(
            instruction=f"The SQLite database `shop.db` has tables `customers` and `{table}`. Write {question} to `answer.txt`.",
            files={"shop.db": blob},
            reference=(ref,),
            check={"expected": [answer]})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


# ----------------------------------------------------------------------------- 13. logs
class LogTop(Family):
    name = "log_top"
    CLASSES = {"4xx": lambda s: 400 <= s < 500, "5xx": lambda s: 500 <= s < 600, "404": lambda s: s == 404,
               "500": lambda s: s == 500, "503": lambda s: s == 503}

    def variants(self):
        return list(product(tuple(self.CLASSES), ("ip", "path"), (1, 3)))

    def generate(self, rng, variant):
        cls, what, k = variant
        ips = [f"10.{rng.randint(0, 9)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}" for _ in range(8)]
        paths = ["/", "/login", "/api/items", "/api/users", "/static/app.js", "/health", "/admin", "/search"]
        statuses = [200, 200, 200, 301, 404, 404, 403, 500, 503, 502]
        lines, counts = [], Counter()
        match = self.CLASSES[cls]
        for i in range(rng.randint(120, 200)):
            ip, path = rng.choice(ips), rng.choice(paths)
            status = rng.choice(statuses)
            day = 1 + i // 60
            lines.append(f'{ip} - - [{day:02d}/Mar/2024:{(i // 3) % 24:02d}:{i % 60:02d}:00 +0000] '
                         f'"{rng.choice(("GET", "POST"))} {path} HTTP/1.1" {status} {rng.randint(100, 9000)}')
            if match(status):
                counts[ip if what == "ip" else path] += 1
        expected = [key for key, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]
        field_no = 1 if what == "ip" else 7
        cond = {"4xx": "$9 ~ /^4/", "5xx": "$9 ~ /^5/"}.get(cls, f"$9 == {cls}")
        return Instance(
            instruction=(f"`access.log` is a web server log in Common Log Format. Find the {k} "
                         f"{'client IP addresses' if what == 'ip' else 'request paths'} with the most responses whose status "
                         f"is {cls}. Write them to `answer.txt`, one per line, most frequent first, ties broken by byte order."),
            files={"access.log": ("\n".join(lines) + "\n").encode()},
            reference=(f"awk '{cond} {{print ${field_no}}}' access.log | LC_ALL=C sort | uniq -c | "
                       f"LC_ALL=C sort -k1,1nr -k2,2 | head -n {k} | awk '{{print $2}}' > answer.txt",),
            check={"expected": expected})

    def check(self, g, data):
        return _answer_is(g, data["expected"])


# ----------------------------------------------------------------------------- 14. cron
_CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
_CRON_NAMES = ({}, {}, {}, {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m},
               {d.lower(): (i + 1) % 7 for i, d in enumerate(calendar.day_abbr)})
_CRON_MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
                "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}


def _cron_field(text: str, idx: int) -> set[int]:
    lo, hi = _CRON_RANGES[idx]
    out: set[int] = set()
    for part in text.lower().split(","):
        rng_part, _, step_s = part.partition("/")
        step = int(step_s) if step_s else 1
        if step < 1:
            raise ValueError(f"bad step in {text!r}")
        if rng_part == "*":
            a, b = lo, hi
        else:
            a_s, dash, b_s = rng_part.partition("-")
            a = int(_CRON_NAMES[idx].get(a_s, a_s))
            b = int(_CRON_NAMES[idx].get(b_s, b_s)) if dash else (hi if step_s else a)
        if not (lo <= a <= hi and lo <= b <= hi and a <= b):
            raise ValueError(f"value out of range in {text!r}")
        out.update(range(a, b + 1, step))
    if idx == 4 and 7 in out:  # 0 and 7 both mean Sunday
        out = (out - {7}) | {0}
    return out


def cron_schedule_key(fields: list[str]) -> tuple:
    """A canonical form of a 5-field schedule: (minutes, hours, the set of matching days of 2027-2028).

    Comparing days over two whole years (one leap) captures cron's day rule exactly: when both
    day-of-month and day-of-week are restricted (neither starts with `*`) a day matches if
    *either* does (Vixie cron); otherwise both must.
    """
    mins, hours, doms, months, dows = (_cron_field(f, i) for i, f in enumerate(fields))
    dom_star, dow_star = fields[2].startswith("*"), fields[4].startswith("*")
    days = []
    for year in (2027, 2028):
        for month in sorted(months):
            for day in range(1, calendar.monthrange(year, month)[1] + 1):
                dow = (calendar.weekday(year, month, day) + 1) % 7  # cron: 0 = Sunday
                dm, ww = day in doms, dow in dows
                if (dm or ww) if not (dom_star or dow_star) else (dm and ww):
                    days.append((year, month, day))
    return tuple(sorted(mins)), tuple(sorted(hours)), tuple(days)


def parse_crontab(text: str) -> list[tuple[tuple, str]]:
    """Entries of a crontab as (schedule key, command); blank lines, comments and VAR=value skipped."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#") or re.match(r"^[A-Za-z_][A-Za-z0-9_]*\s*=", s):
            continue
        if s.startswith("@"):
            macro, _, cmd = s.partition(" ")
            if macro not in _CRON_MACROS:
                raise ValueError(f"unknown macro {macro!r}")
            fields = _CRON_MACROS[macro].split()
        else:
            parts = s.split(None, 5)
            if len(parts) < 6:
                raise ValueError(f"not a cron entry: {s!r}")
            fields, cmd = parts[:5], parts[5]
        out.append((cron_schedule_key(fields), cmd.strip()))
    return out


class CronSchedule(Family):
    name = "cron_schedule"
    DAYS = ("Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")

    def variants(self):
        return list(product(("backup.sh", "rotate.sh", "report.sh", "sync.sh"),
                            ("daily_at", "every_n_weekdays", "weekly_on", "monthly_on")))

    def generate(self, rng, variant):
        script, kind = variant
        h, m = rng.randint(0, 23), rng.randint(0, 59)
        if kind == "daily_at":
            fields, desc = f"{m} {h} * * *", f"every day at {h:02d}:{m:02d}"
        elif kind == "every_n_weekdays":
            n = rng.choice((5, 10, 15, 20, 30))
            fields, desc = f"*/{n} * * * 1-5", f"every {n} minutes (at minutes divisible by {n}), Monday to Friday only"
        elif kind == "weekly_on":
            d = rng.randint(0, 6)
            fields, desc = f"{m} {h} * * {d}", f"every {self.DAYS[d]} at {h:02d}:{m:02d}"
        else:
            d = rng.randint(1, 28)
            fields, desc = f"{m} {h} {d} * *", f"on day {d} of every month at {h:02d}:{m:02d}"
        existing = [f"{rng.randint(0, 59)} {rng.randint(0, 23)} * * * /opt/jobs/{rng.choice(('clean', 'mail'))}.sh",
                    "@hourly /opt/jobs/ping.sh"]
        text = "# jobs for the app server\nSHELL=/bin/sh\n" + "\n".join(existing) + "\n"
        entry = f"{fields} /opt/jobs/{script}"
        return Instance(
            instruction=(f"Add an entry to the crontab file `jobs.cron` that runs `/opt/jobs/{script}` {desc}. Use the "
                         f"standard 5-field syntax (minute hour day-of-month month day-of-week, then the command) and keep "
                         f"the existing entries."),
            files={"jobs.cron": text.encode()},
            reference=(f"echo {shlex.quote(entry)} >> jobs.cron",),
            check={"new": entry, "existing": existing})

    def check(self, g, data):
        text = g.read_text("jobs.cron", max_bytes=64 << 10)
        if text is None:
            return 0.0
        try:
            got = parse_crontab(text)
            want = parse_crontab("\n".join(data["existing"] + [data["new"]]))
        except (ValueError, IndexError):
            return 0.0
        return float(sorted(got) == sorted(want))


FAMILIES: dict[str, Family] = {f.name: f for f in (
    GrepCount(), FindLarge(), SedConfig(), WordFreq(), AwkAggregate(), JsonFilter(), CsvGroupBy(), TarCreate(),
    Permissions(), ShellScript(), GitRescue(), SqliteQuery(), LogTop(), CronSchedule())}
