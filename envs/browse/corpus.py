"""The corpus interface of the browsing domain, and two implementations that read it from disk.

A corpus is a set of HTML pages addressed by path (``/wiki/glass-river``) plus a question set whose
answers can be found by reading those pages. The browsing environment only talks to the
:class:`Corpus` protocol, so the generated web (``synth.py``) and a real document collection
(:class:`DirectoryCorpus`: a folder of .html/.txt/.md files plus a ``questions.jsonl``) plug in the
same way. This module holds records and file I/O only: no search index (``index.py``), no HTTP
(``server.py``), no grading (``grading.py``).
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Protocol, Sequence, runtime_checkable

PATH_RE = re.compile(r"^/[A-Za-z0-9._~\-/]*$")


class CorpusError(ValueError):
    """A corpus on disk is missing, malformed, or asked for a page it does not have."""


@dataclass(frozen=True)
class Page:
    """One web page. `path` is the URL path the server answers to; `html` is the served document."""

    path: str
    title: str
    html: str


@dataclass(frozen=True)
class Question:
    """One research question with its recorded evidence path (for the grader and the reference agent).

    `evidence` lists the page paths an agent must read, in order; `relations` gives, for each page
    but the last, the label of the row whose link leads to the next page (``Creator``, shown as
    ``Creator: [Name][n]``); the answer is printed on
    `evidence[-1]` in the row labelled `answer_field`. `hops` == len(evidence): the number of
    pages on the path. `candidates` are plausible wrong answers of the same kind (for the answer
    stuffing check); `injected` says whether a page on the path carries a prompt injection.
    """

    id: str
    text: str
    answer: str
    hops: int
    evidence: tuple[str, ...]
    relations: tuple[str, ...]
    answer_field: str
    answer_kind: str  # "year" | "number" | "value" | "name"
    start_query: str  # what a sensible agent would type to find evidence[0]
    aliases: tuple[str, ...] = ()
    candidates: tuple[str, ...] = ()
    injected: bool = False
    split: str = "train"

    def __post_init__(self) -> None:
        if self.hops != len(self.evidence) or self.hops < 1:
            raise CorpusError(f"question {self.id}: hops={self.hops} but evidence has {len(self.evidence)} pages")
        if len(self.relations) != len(self.evidence) - 1:
            raise CorpusError(f"question {self.id}: {len(self.relations)} relations for {len(self.evidence)} evidence pages")
        if not self.answer.strip():
            raise CorpusError(f"question {self.id}: empty answer")

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @staticmethod
    def from_json(text: str) -> "Question":
        d = json.loads(text)
        for k in ("evidence", "relations", "aliases", "candidates"):
            d[k] = tuple(d.get(k, ()))
        return Question(**d)


@runtime_checkable
class Corpus(Protocol):
    """What the browsing environment needs from a document collection."""

    name: str

    def paths(self) -> Sequence[str]:
        """Every page path, in a stable order."""

    def page(self, path: str) -> Page:
        """The page at `path`; raises KeyError if there is none."""

    def questions(self) -> Sequence[Question]:
        """The question set (may be empty for a corpus used only for free browsing)."""


def check_path(path: str) -> str:
    """Refuse paths that could escape a page directory (`..`, backslashes, odd characters)."""
    if not PATH_RE.match(path) or "/../" in path + "/" or "//" in path:
        raise KeyError(f"invalid page path {path!r}")
    return path


def path_to_file(root: Path, path: str) -> Path:
    """Where a page path lives under `root` (`/` is `index.html`, `/wiki/x` is `wiki/x.html`)."""
    check_path(path)
    rel = "index" if path == "/" else path.strip("/")
    return root / f"{rel}.html"


# ----------------------------------------------------------------------------- on-disk corpora
@dataclass(frozen=True)
class CorpusManifest:
    """What `manifest.json` of a built corpus says about it."""

    name: str
    kind: str  # "synthetic" or "directory"
    seed: int
    num_pages: int
    num_questions: int
    version: int
    params: dict = field(default_factory=dict)


class DiskCorpus:
    """A corpus written by `synth.build_corpus` (or any tool using the same layout):

    ``root/manifest.json``, ``root/pages/<path>.html``, ``root/paths.txt`` (one path per line),
    ``root/questions.jsonl``. Pages are read lazily, so opening a 10k-page corpus is cheap.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        mpath = self.root / "manifest.json"
        if not mpath.is_file():
            raise CorpusError(f"no corpus at {self.root}: {mpath.name} is missing (build it with scripts/build_browse_corpus.py)")
        self.manifest = CorpusManifest(**json.loads(mpath.read_text()))
        self.name = self.manifest.name
        self._paths = tuple(p for p in (self.root / "paths.txt").read_text().splitlines() if p)
        self._path_set = frozenset(self._paths)
        self._questions: tuple[Question, ...] | None = None

    def paths(self) -> Sequence[str]:
        return self._paths

    def page(self, path: str) -> Page:
        if path not in self._path_set:
            raise KeyError(f"no page {path!r} in corpus {self.name}")
        text = path_to_file(self.root / "pages", path).read_text(encoding="utf-8")
        m = re.search(r"<title>(.*?)</title>", text, re.S)
        return Page(path=path, title=html.unescape(m.group(1)) if m else path, html=text)

    def questions(self) -> Sequence[Question]:
        if self._questions is None:
            qpath = self.root / "questions.jsonl"
            lines = qpath.read_text(encoding="utf-8").splitlines() if qpath.exists() else []
            self._questions = tuple(Question.from_json(line) for line in lines if line.strip())
        return self._questions


def write_corpus(root: Path, name: str, kind: str, seed: int, pages: Iterator[Page] | Sequence[Page],
                 questions: Sequence[Question], params: dict, version: int, progress=None) -> DiskCorpus:
    """Write pages + questions in the DiskCorpus layout; `manifest.json` last, so a crash leaves no valid corpus."""
    root.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    for p in pages:
        f = path_to_file(root / "pages", p.path)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(p.html, encoding="utf-8")
        paths.append(p.path)
        if progress is not None:
            progress.update(1)
    if len(set(paths)) != len(paths):
        raise CorpusError("duplicate page paths in corpus")
    (root / "paths.txt").write_text("\n".join(paths) + "\n")
    (root / "questions.jsonl").write_text("".join(q.to_json() + "\n" for q in questions), encoding="utf-8")
    manifest = CorpusManifest(name=name, kind=kind, seed=seed, num_pages=len(paths),
                              num_questions=len(questions), version=version, params=params)
    (root / "manifest.json").write_text(json.dumps(asdict(manifest), indent=1))
    return DiskCorpus(root)


class DirectoryCorpus:
    """A real document collection: every .html/.htm/.txt/.md file under `root` becomes a page.

    Plain-text files are wrapped in ``<pre>``; the page path is ``/doc/<relative path>`` with
    characters outside ``[A-Za-z0-9._~-/]`` replaced by ``_``. Questions come from an optional
    ``questions.jsonl`` (Question records, evidence given as page paths) next to the documents or
    passed in explicitly. Files larger than `max_bytes` are skipped (binary dumps, logs).
    """

    SUFFIXES = (".html", ".htm", ".txt", ".md")

    def __init__(self, root: str | Path, name: str | None = None, questions_file: str | Path | None = None,
                 max_bytes: int = 2_000_000):
        self.root = Path(root)
        if not self.root.is_dir():
            raise CorpusError(f"DirectoryCorpus: {self.root} is not a directory")
        self.name = name or self.root.name
        self._files: dict[str, Path] = {}
        for f in sorted(self.root.rglob("*")):
            if f.is_file() and not f.is_symlink() and f.suffix.lower() in self.SUFFIXES and f.stat().st_size <= max_bytes:
                rel = f.relative_to(self.root).as_posix()
                path = "/doc/" + re.sub(r"[^A-Za-z0-9._~\-/]", "_", rel)
                self._files.setdefault(path, f)
        if not self._files:
            raise CorpusError(f"DirectoryCorpus: no {'/'.join(self.SUFFIXES)} files under {self.root}")
        qfile = Path(questions_file) if questions_file else self.root / "questions.jsonl"
        self._questions = tuple(Question.from_json(l) for l in qfile.read_text().splitlines() if l.strip()) if qfile.is_file() else ()
        for q in self._questions:
            missing = [p for p in q.evidence if p not in self._files]
            if missing:
                raise CorpusError(f"question {q.id} cites pages not in the corpus: {missing}")

    def paths(self) -> Sequence[str]:
        return tuple(self._files)

    def page(self, path: str) -> Page:
        f = self._files.get(path)
        if f is None:
            raise KeyError(f"no page {path!r} in corpus {self.name}")
        raw = f.read_text(encoding="utf-8", errors="replace")
        if f.suffix.lower() in (".html", ".htm"):
            m = re.search(r"<title>(.*?)</title>", raw, re.S | re.I)
            title = html.unescape(m.group(1).strip()) if m else f.name
            return Page(path=path, title=title, html=raw)
        title = next((l.lstrip("# ").strip() for l in raw.splitlines() if l.strip()), f.name)
        body = f"<html><head><title>{html.escape(title)}</title></head><body><pre>{html.escape(raw)}</pre></body></html>"
        return Page(path=path, title=title, html=body)

    def questions(self) -> Sequence[Question]:
        return self._questions
