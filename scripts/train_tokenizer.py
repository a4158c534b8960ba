"""Train the project's byte-level BPE tokenizer (vocab 8192) and write `model/tokenizer/`.

What it does
- Builds a modest training corpus (~8 MB) from text available offline, in a fixed order:
  Python sources of *pinned* packages (transformers, datasets, pytest, cadquery: code, docstrings
  = English prose) plus deterministic synthetic text with a fixed seed (shell sessions with
  command outputs, tracebacks and diffs; JSON tool calls, schemas and results; CadQuery scripts).
  Pinned packages rather than the Python stdlib so that any machine set up by scripts/setup.sh
  sees the same bytes (the stdlib changes with every Python patch release).
- Trains a byte-level BPE with the `tokenizers` library; the 11 chat special tokens get ids 0-10
  in the order of `model.chat.SPECIAL_TOKENS`.
- Writes tokenizer.json, tokenizer_config.json (with `model.chat.CHAT_TEMPLATE`),
  special_tokens_map.json and corpus_manifest.json (versions + sha256 of every corpus group, so
  a reproduction check can tell "different environment" from "non-deterministic training").
- Prints bytes/token per corpus group and on held-out text (stdlib modules, the repo's docs/ if
  present), for docs/chat_format.md.

What it does not do
- Download anything, or use docs/ / stdlib for training (held-out only).

Run: .venv/bin/python scripts/train_tokenizer.py [--out model/tokenizer]
Running it again reproduces the shipped files byte for byte (tests/model/test_tokenizer.py).
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.metadata
import importlib.util
import json
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from model.chat import CHAT_TEMPLATE, EOS_TOKEN, NON_SKIPPED_TOKENS, PAD_TOKEN, SPECIAL_TOKENS  # noqa: E402

VOCAB_SIZE = 8192
SEED = 20261130
MIN_FREQUENCY = 2
# Pre-tokenisation split (the cl100k / Qwen2 family of patterns): letters with one optional
# leading non-letter, single digits (numbers are read digit by digit: better arithmetic with a
# small vocabulary), punctuation runs with trailing newlines, newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MODEL_MAX_LENGTH = 1_048_576  # the target model's context (seeds: 1M tokens)


@dataclass(frozen=True)
class PackageSource:
    """Python files of one installed, pinned distribution (globs relative to the import root)."""

    dist: str  # distribution name for importlib.metadata
    version: str  # the version pinned in pyproject.toml
    module: str  # top-level import name
    globs: tuple[str, ...]


PACKAGE_SOURCES: tuple[PackageSource, ...] = (
    PackageSource("transformers", "5.19.0", "transformers", (
        "*.py",
        "models/qwen3_moe/*.py",
        "models/mixtral/*.py",
        "models/llama/*.py",
        "models/gpt2/*.py",
    )),
    PackageSource("datasets", "5.2.0", "datasets", ("*.py",)),
    PackageSource("pytest", "9.2.0", "_pytest", ("**/*.py",)),
    PackageSource("cadquery", "2.8.0", "cadquery", ("**/*.py",)),
)
# Held-out text for the printed compression figures only (never trained on).
HELD_OUT_STDLIB = ("json/decoder.py", "argparse.py", "subprocess.py", "pathlib.py", "pydoc_data/topics.py")
# The project's own prose (never in the training corpus) stands in for English technical text.
HELD_OUT_DOCS = Path(__file__).resolve().parents[1] / "docs"


@dataclass(frozen=True)
class CorpusGroup:
    """One named slice of the corpus; `texts` in a fixed order."""

    name: str
    texts: tuple[str, ...]

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in self.texts:
            b = t.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        return h.hexdigest()

    @property
    def n_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.texts)


# --------------------------------------------------------------------------- pinned packages
def package_root(module: str) -> Path:
    spec = importlib.util.find_spec(module)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"train_tokenizer: package {module!r} is not installed (run scripts/setup.sh)")
    return Path(list(spec.submodule_search_locations)[0])


def package_group(src: PackageSource, allow_version_mismatch: bool) -> CorpusGroup:
    installed = importlib.metadata.version(src.dist)
    if installed != src.version and not allow_version_mismatch:
        raise SystemExit(
            f"train_tokenizer: {src.dist} {installed} is installed but the corpus is defined on the "
            f"pinned {src.version}; install the pin or pass --allow-version-mismatch (the result "
            f"will then differ from the shipped tokenizer)"
        )
    root = package_root(src.module)
    files = sorted({p for g in src.globs for p in root.glob(g) if p.is_file() and "__pycache__" not in p.parts})
    if not files:
        raise SystemExit(f"train_tokenizer: no files matched {src.globs} under {root}")
    # Sorted relative paths fix the order; invalid UTF-8 (none expected) is replaced, not skipped.
    texts = tuple(p.read_text(encoding="utf-8", errors="replace") for p in sorted(files, key=lambda p: p.relative_to(root).as_posix()))
    return CorpusGroup(f"pkg:{src.dist}=={src.version}", texts)


# --------------------------------------------------------------------------- synthetic text
WORDS = (
    "data model config value result error file path test cache index buffer token batch step "
    "loss reward policy expert router layer weight query search page title report price sales "
    "user order item table column row record server client request response status message "
    "input output stream parse build check load save update create delete merge split sort "
    "filter count total average maximum minimum length width height depth radius angle"
).split()
FILE_NAMES = (
    "main.py", "utils.py", "models.py", "config.py", "cli.py", "io.py", "parser.py", "server.py",
    "test_utils.py", "test_models.py", "test_parser.py", "README.md", "setup.cfg", "pyproject.toml",
    "requirements.txt", "Makefile", "data.json", "results.csv", "notes.txt", "app.log", "part.step",
)
DIRS = ("src", "tests", "docs", "scripts", "data", "build", "lib", "pkg", "examples", "output")
USERS = ("agent", "root", "dev", "ci")
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
EXCEPTIONS = (
    ("ValueError", "invalid literal for int() with base 10: '{w}'"),
    ("KeyError", "'{w}'"),
    ("TypeError", "unsupported operand type(s) for +: 'int' and 'str'"),
    ("AttributeError", "'NoneType' object has no attribute '{w}'"),
    ("FileNotFoundError", "[Errno 2] No such file or directory: '{f}'"),
    ("IndexError", "list index out of range"),
    ("ZeroDivisionError", "division by zero"),
    ("ModuleNotFoundError", "No module named '{w}'"),
    ("AssertionError", "expected {n}, got {m}"),
)


def _ident(rng: random.Random) -> str:
    return "_".join(rng.sample(WORDS, rng.randint(1, 3)))


def _code_lines(code_texts: tuple[str, ...], rng: random.Random, n: int) -> list[str]:
    text = code_texts[rng.randrange(len(code_texts))]
    lines = text.splitlines()
    if len(lines) <= n:
        return lines
    start = rng.randrange(len(lines) - n)
    return lines[start : start + n]


def _ls_la(rng: random.Random) -> str:
    names = rng.sample(FILE_NAMES + DIRS, rng.randint(3, 12))
    rows = [f"total {rng.randint(4, 400)}"]
    for name in [".", ".."] + sorted(names):
        is_dir = name in DIRS or name in (".", "..")
        perm = "drwxr-xr-x" if is_dir else rng.choice(("-rw-r--r--", "-rwxr-xr-x", "-rw-------"))
        size = 4096 if is_dir else rng.randint(0, 200_000)
        u = rng.choice(USERS)
        when = f"{rng.choice(MONTHS)} {rng.randint(1, 28):2d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        rows.append(f"{perm} {rng.randint(1, 9)} {u} {u} {size:>7} {when} {name}")
    return "\n".join(rows)


def _traceback(rng: random.Random, code: tuple[str, ...]) -> str:
    frames = ["Traceback (most recent call last):"]
    for _ in range(rng.randint(1, 4)):
        f = f"{rng.choice(DIRS)}/{rng.choice(FILE_NAMES[:9])}"
        line = next((l.strip() for l in _code_lines(code, rng, 5) if l.strip()), "main()")
        frames.append(f'  File "/workspace/{f}", line {rng.randint(1, 900)}, in {_ident(rng)}\n    {line}')
    exc, msg = rng.choice(EXCEPTIONS)
    msg = msg.format(w=rng.choice(WORDS), f=rng.choice(FILE_NAMES), n=rng.randint(0, 99), m=rng.randint(0, 99))
    frames.append(f"{exc}: {msg}")
    return "\n".join(frames)


def _pytest_run(rng: random.Random, code: tuple[str, ...]) -> str:
    n_pass, n_fail = rng.randint(0, 60), rng.choice((0, 0, 1, 2, 3))
    dots = "".join(rng.sample("." * n_pass + "F" * n_fail, n_pass + n_fail))
    out = [f"{dots:<70} [100%]" if dots else "no tests ran"]
    fails = []
    for _ in range(n_fail):
        name = f"test_{_ident(rng)}"
        f = f"tests/{rng.choice(FILE_NAMES[8:11])}"
        a, b = rng.randint(0, 50), rng.randint(51, 99)
        out.append(f"{'=' * 20} FAILURES {'=' * 20}\n{'_' * 15} {name} {'_' * 15}\n")
        out.append(f"    def {name}():\n>       assert {_ident(rng)}({a}) == {b}\nE       assert {a * 2} == {b}")
        out.append(f"E        +  where {a * 2} = {_ident(rng)}({a})\n\n{f}:{rng.randint(3, 300)}: AssertionError")
        fails.append(f"FAILED {f}::{name} - assert {a * 2} == {b}")
    if fails:
        out.append(f"{'=' * 10} short test summary info {'=' * 10}\n" + "\n".join(fails))
    summary = ", ".join(s for s in (f"{n_fail} failed" if n_fail else "", f"{n_pass} passed" if n_pass else "") if s)
    out.append(f"{summary or 'no tests ran'} in {rng.uniform(0.01, 9):.2f}s")
    return "\n".join(out)


def _mutate(line: str, rng: random.Random) -> str:
    for a, b in (("==", "!="), ("<", "<="), (" + 1", " - 1"), ("True", "False"), ("and", "or"), ("0", "1")):
        if a in line and rng.random() < 0.7:
            return line.replace(a, b, 1)
    return line + "  # " + rng.choice(WORDS)


def _git_diff(rng: random.Random, code: tuple[str, ...]) -> str:
    old = _code_lines(code, rng, rng.randint(6, 20))
    new = list(old)
    for _ in range(rng.randint(1, 3)):
        if new:
            i = rng.randrange(len(new))
            new[i] = _mutate(new[i], rng)
    f = f"{rng.choice(DIRS)}/{rng.choice(FILE_NAMES[:9])}"
    start = rng.randint(1, 500)
    diff = difflib.unified_diff(old, new, f"a/{f}", f"b/{f}", lineterm="", n=3)
    body = "\n".join(diff).replace("@@ -1,", f"@@ -{start},").replace(" +1,", f" +{start},")
    h = "".join(rng.choice("0123456789abcdef") for _ in range(7))
    return f"diff --git a/{f} b/{f}\nindex {h}..{h[::-1]} 100644\n{body}"


def _shell_command(rng: random.Random, code: tuple[str, ...]) -> str:
    kind = rng.randrange(14)
    f = f"{rng.choice(DIRS)}/{rng.choice(FILE_NAMES)}"
    if kind == 0:
        return f"$ ls -la {rng.choice(DIRS)}\n{_ls_la(rng)}"
    if kind == 1:
        lines = _code_lines(code, rng, rng.randint(5, 30))
        start = rng.randint(1, 400)
        return f"$ sed -n '{start},{start + len(lines) - 1}p' {f}\n" + "\n".join(lines)
    if kind == 2:
        pat = rng.choice(("def ", "class ", "import ", "return ", "self.", "raise ", "TODO"))
        hits = [l for l in _code_lines(code, rng, 200) if pat in l][: rng.randint(1, 12)]
        rows = [f"{rng.choice(DIRS)}/{rng.choice(FILE_NAMES[:9])}:{rng.randint(1, 999)}:{l}" for l in hits]
        return f"$ grep -rn \"{pat.strip()}\" {rng.choice(DIRS)}/\n" + "\n".join(rows)
    if kind == 3:
        return f"$ python -m pytest -q {rng.choice(('tests/', 'tests/' + rng.choice(FILE_NAMES[8:11]), '-x'))}\n{_pytest_run(rng, code)}"
    if kind == 4:
        return f"$ python {rng.choice(DIRS)}/{rng.choice(FILE_NAMES[:9])}\n{_traceback(rng, code)}"
    if kind == 5:
        return f"$ git diff\n{_git_diff(rng, code)}"
    if kind == 6:
        rows = [f"{''.join(rng.choice('0123456789abcdef') for _ in range(7))} {rng.choice(('Fix', 'Add', 'Update', 'Refactor', 'Remove'))} {' '.join(rng.sample(WORDS, 3))}" for _ in range(rng.randint(2, 8))]
        return "$ git log --oneline\n" + "\n".join(rows)
    if kind == 7:
        ch = [f"\tmodified:   {rng.choice(DIRS)}/{rng.choice(FILE_NAMES)}" for _ in range(rng.randint(1, 4))]
        return "$ git status\nOn branch main\nChanges not staged for commit:\n  (use \"git add <file>...\" to update what will be committed)\n" + "\n".join(ch)
    if kind == 8:
        rows = [f"./{rng.choice(DIRS)}/{rng.choice(FILE_NAMES)}" for _ in range(rng.randint(1, 10))]
        return f"$ find . -name \"*{rng.choice(('.py', '.json', '.md', '.txt'))}\" | head\n" + "\n".join(rows)
    if kind == 9:
        rows = [f"{rng.randint(1, 3000):>6} {rng.choice(DIRS)}/{rng.choice(FILE_NAMES)}" for _ in range(rng.randint(1, 6))]
        return "$ wc -l " + " ".join(r.split()[1] for r in rows) + "\n" + "\n".join(rows)
    if kind == 10:
        pkg = rng.choice(("requests", "numpy", "pandas", "toolz", "cachetools", "tabulate", "pyyaml"))
        return (f"$ pip install {pkg}\nCollecting {pkg}\n  Using cached {pkg}-{rng.randint(0, 3)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}-py3-none-any.whl "
                f"({rng.randint(10, 900)} kB)\nInstalling collected packages: {pkg}\nSuccessfully installed {pkg}")
    if kind == 11:
        return (f"$ df -h /\nFilesystem      Size  Used Avail Use% Mounted on\n"
                f"overlay          {rng.randint(20, 500)}G  {rng.randint(1, 19)}G  {rng.randint(1, 400)}G  {rng.randint(1, 99)}% /")
    if kind == 12:
        lines = _code_lines(code, rng, rng.randint(4, 15))
        return f"$ cat > {f} << 'EOF'\n" + "\n".join(lines) + "\nEOF\n$ echo $?\n0"
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    return f"$ python3 -c \"print({a} * {b}, {a} // {b}, {a} % {b})\"\n{a * b} {a // b} {a % b}"


def shell_group(code: tuple[str, ...], rng: random.Random, n_sessions: int) -> CorpusGroup:
    texts = []
    for _ in range(n_sessions):
        cmds = [_shell_command(rng, code) for _ in range(rng.randint(2, 8))]
        texts.append("\n".join(cmds) + "\n")
    return CorpusGroup("synthetic:shell", tuple(texts))


TOOL_SCHEMAS = (
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command in the sandbox and return its output.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The command line to run."},
     "timeout": {"type": "integer", "description": "Seconds before the command is killed."}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a text file from the workspace.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start_line": {"type": "integer"},
     "end_line": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write text to a file, replacing its content.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the document collection and return the best matches.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "open_page", "description": "Open a document by id and return its text.",
     "parameters": {"type": "object", "properties": {"doc_id": {"type": "string"}}, "required": ["doc_id"]}}},
    {"type": "function", "function": {"name": "run_cad", "description": "Run a CadQuery script and return volume, bounding box and errors.",
     "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Submit the final answer and end the task.",
     "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}},
)


def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-1000, 100000)
    if kind == 1:
        return round(rng.uniform(-100, 100), rng.randint(0, 4))
    if kind == 2:
        return " ".join(rng.sample(WORDS, rng.randint(1, 6)))
    if kind == 3:
        return rng.choice((True, False, None))
    if kind in (4, 5):
        return {_ident(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 5))}
    return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def json_group(code: tuple[str, ...], rng: random.Random, n_docs: int) -> CorpusGroup:
    texts = []
    for _ in range(n_docs):
        kind = rng.randrange(5)
        if kind == 0:
            obj = rng.choice(TOOL_SCHEMAS)
        elif kind == 1:
            name = rng.choice(TOOL_SCHEMAS)["function"]["name"]
            args = {"command": _shell_command(rng, code).split("\n")[0][2:]} if name == "bash" else {_ident(rng): _json_value(rng, 1)}
            obj = {"name": name, "arguments": args}
        elif kind == 2:
            obj = {"exit_code": rng.choice((0, 0, 0, 1, 2, 127)), "stdout": "\n".join(_code_lines(code, rng, rng.randint(1, 6))), "stderr": ""}
        elif kind == 3:
            obj = {"results": [{"doc_id": f"doc-{rng.randint(1, 99999)}", "title": " ".join(rng.sample(WORDS, 4)).title(),
                                "score": round(rng.uniform(0, 30), 3), "snippet": " ".join(rng.sample(WORDS, 12))} for _ in range(rng.randint(1, 5))]}
        else:
            obj = _json_value(rng)
        style = rng.randrange(3)
        if style == 0:
            texts.append(json.dumps(obj, ensure_ascii=False))
        elif style == 1:
            texts.append(json.dumps(obj, ensure_ascii=False, indent=2))
        else:
            texts.append(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
    return CorpusGroup("synthetic:json", tuple(t + "\n" for t in texts))


def _cad_script(rng: random.Random) -> str:
    def num(lo: float, hi: float) -> str:
        return f"{rng.uniform(lo, hi):.{rng.choice((0, 1, 1, 2))}f}"

    plane = rng.choice(('"XY"', '"XZ"', '"YZ"'))
    base = rng.choice((
        f".box({num(10, 200)}, {num(10, 200)}, {num(2, 50)})",
        f".cylinder({num(5, 100)}, {num(2, 60)})",
        f".circle({num(2, 80)}).extrude({num(1, 100)})",
        f".rect({num(10, 150)}, {num(10, 150)}).extrude({num(1, 40)})",
        f".polygon({rng.randint(3, 8)}, {num(10, 120)}).extrude({num(1, 30)})",
        f".sphere({num(5, 60)})",
    ))
    ops = []
    for _ in range(rng.randint(1, 6)):
        face = rng.choice(('">Z"', '"<Z"', '">X"', '"<Y"', '"|Z"'))
        edges = rng.choice(('"|Z"', '">Z"', '"#Z"'))
        ops.append(rng.choice((
            f'.faces({face}).workplane().hole({num(1, 20)})',
            f'.faces({face}).workplane().rect({num(5, 80)}, {num(5, 80)}, forConstruction=True).vertices().hole({num(1, 12)})',
            f'.edges({edges}).fillet({num(0.5, 5)})',
            f'.edges().chamfer({num(0.2, 3)})',
            f'.faces({face}).shell({num(-5, -0.5)})',
            f'.faces({face}).workplane().cboreHole({num(2, 10)}, {num(11, 20)}, {num(1, 5)})',
            f'.faces({face}).workplane(offset={num(0, 10)}).circle({num(1, 30)}).cutBlind(-{num(1, 20)})',
            f'.translate(({num(-50, 50)}, {num(-50, 50)}, {num(-50, 50)}))',
        )))
    var = rng.choice(("result", "part", "plate", "bracket", "body", "housing"))
    lines = ["import cadquery as cq", "", f"# {' '.join(rng.sample(WORDS, rng.randint(3, 8))).capitalize()}"]
    lines.append(f"{var} = (\n    cq.Workplane({plane})\n    " + "\n    ".join([base] + ops) + "\n)")
    if rng.random() < 0.3:
        lines.append(f"cutter = cq.Workplane({plane}).box({num(5, 50)}, {num(5, 50)}, {num(5, 50)})")
        lines.append(f"{var} = {var}.{rng.choice(('cut', 'union', 'intersect'))}(cutter)")
    lines.append(rng.choice((f'cq.exporters.export({var}, "{var}.step")', f"show_object({var})", f"print({var}.val().Volume())")))
    return "\n".join(lines) + "\n"


def cad_group(rng: random.Random, n_scripts: int) -> CorpusGroup:
    return CorpusGroup("synthetic:cadquery", tuple(_cad_script(rng) for _ in range(n_scripts)))


def build_corpus(allow_version_mismatch: bool = False) -> tuple[CorpusGroup, ...]:
    """All corpus groups in training order (deterministic)."""
    groups = [package_group(s, allow_version_mismatch) for s in PACKAGE_SOURCES]
    code = tuple(t for g in groups for t in g.texts)
    rng = random.Random(SEED)
    groups.append(shell_group(code, rng, n_sessions=1200))
    groups.append(json_group(code, rng, n_docs=4000))
    groups.append(cad_group(rng, n_scripts=2000))
    return tuple(groups)


# --------------------------------------------------------------------------- training + files
def train(groups: tuple[CorpusGroup, ...]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[AddedToken(t, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [t for g in groups for t in g.texts]
    tok.train_from_iterator(texts, trainer, length=len(texts))
    # The trainer marks every added token special. <think>, <tool_call>, ... must be non-special
    # so that decoding with skip_special_tokens=True (vLLM's default) keeps them in the text that
    # reasoning / tool-call parsers read; they stay atomic added tokens either way.
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] in NON_SKIPPED_TOKENS:
            entry["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"train_tokenizer: got vocab {tok.get_vocab_size()}, want {VOCAB_SIZE}: corpus too small?")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise SystemExit(f"train_tokenizer: {t!r} got id {tok.token_to_id(t)}, want {i}")
    return tok


def _additional_special() -> list[str]:
    # Only truly special tokens: transformers treats everything listed here as skippable
    # (`all_special_ids`), which would strip <think> / <tool_call> from decoded generations.
    return [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN) and t not in NON_SKIPPED_TOKENS]


def tokenizer_config() -> dict:
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS):
        added[str(i)] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": t not in NON_SKIPPED_TOKENS}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": _additional_special(),
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": _additional_special(),
    }


def manifest(groups: tuple[CorpusGroup, ...]) -> dict:
    import tokenizers

    return {
        "vocab_size": VOCAB_SIZE,
        "seed": SEED,
        "min_frequency": MIN_FREQUENCY,
        "tokenizers_version": tokenizers.__version__,
        "groups": [{"name": g.name, "texts": len(g.texts), "bytes": g.n_bytes, "sha256": g.digest()} for g in groups],
    }


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def write_files(tok, groups: tuple[CorpusGroup, ...], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config()), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(_dump(special_tokens_map()), encoding="utf-8")
    (out / "corpus_manifest.json").write_text(_dump(manifest(groups)), encoding="utf-8")


def held_out_texts() -> list[tuple[str, str]]:
    std = Path(sysconfig.get_paths()["stdlib"])
    out = [(f"stdlib:{n}", (std / n).read_text(encoding="utf-8")) for n in HELD_OUT_STDLIB if (std / n).is_file()]
    if HELD_OUT_DOCS.is_dir():
        out.append(("docs/*.md", "\n".join(p.read_text(encoding="utf-8") for p in sorted(HELD_OUT_DOCS.glob("*.md")))))
    return out


def report(tok, groups: tuple[CorpusGroup, ...]) -> None:
    print(f"{'text':<32} {'bytes':>10} {'tokens':>9} {'bytes/token':>11}")
    rows = [(g.name, "".join(g.texts)) for g in groups] + held_out_texts()
    for name, text in rows:
        n_tok = len(tok.encode(text, add_special_tokens=False).ids)
        n_b = len(text.encode("utf-8"))
        print(f"{name:<32} {n_b:>10} {n_tok:>9} {n_b / max(n_tok, 1):>11.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "model" / "tokenizer", help="output directory")
    ap.add_argument("--allow-version-mismatch", action="store_true", help="train even if pinned package versions differ")
    ap.add_argument("--report", action="store_true", help="print bytes/token per corpus group and held-out text")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    groups = build_corpus(args.allow_version_mismatch)
    t1 = time.perf_counter()
    tok = train(groups)
    t2 = time.perf_counter()
    write_files(tok, groups, args.out)
    total = sum(g.n_bytes for g in groups)
    print(f"corpus {total / 1e6:.2f} MB in {sum(len(g.texts) for g in groups)} texts ({t1 - t0:.1f} s); "
          f"trained vocab {tok.get_vocab_size()} in {t2 - t1:.1f} s; wrote {args.out}")
    if args.report:
        report(tok, groups)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
