"""BM25 full-text search over any `Corpus`, stored in a SQLite FTS5 index.

`build_index(corpus, db_path)` renders every page to plain text (anchor texts kept, link numbers
dropped) and writes an FTS5 table (title, body). `SearchIndex.search(query, k)` turns free text into
an OR of its word tokens and ranks with FTS5's built-in ``bm25()`` (Robertson & Zaragoza, "The
Probabilistic Relevance Framework: BM25 and Beyond", 2009; FTS5 uses k1 = 1.2, b = 0.75,
idf = ln((N - n + 0.5) / (n + 0.5)) floored at 1e-6, and document length summed over all columns),
with the title weighted `TITLE_WEIGHT` times the body. The test suite checks these scores against a
from-the-formula reference. Connections are per thread and read-only (the server answers queries
from many threads). This module does not fetch or serve pages.
"""
from __future__ import annotations

import os
import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from envs.browse.corpus import Corpus
from envs.browse.render import render_html

TITLE_WEIGHT = 4.0
BODY_WEIGHT = 1.0
MAX_QUERY_TERMS = 24
MAX_K = 50
_TOKEN = re.compile(r"[^\W_]+", re.UNICODE)
_LINK_MARK = re.compile(r"\[([^\]]*)\]\[\d+\]")


class SearchError(ValueError):
    """A query the index cannot run (empty, or k out of range)."""


@dataclass(frozen=True)
class SearchHit:
    rank: int  # 1-based
    path: str
    title: str
    snippet: str
    score: float  # BM25 score, higher is better (FTS5 returns it negated)


def plain_text(doc_html: str) -> tuple[str, str]:
    """(title, body text) of a page as indexed: rendered lines, link markers reduced to anchor text."""
    r = render_html(doc_html, width=10_000)
    return r.title, "\n".join(_LINK_MARK.sub(r"\1", line) for line in r.lines)


def query_terms(query: str) -> list[str]:
    """Lower-cased word tokens of a free-text query, de-duplicated, at most MAX_QUERY_TERMS."""
    seen: list[str] = []
    for t in _TOKEN.findall(query.lower()):
        if t not in seen:
            seen.append(t)
    return seen[:MAX_QUERY_TERMS]


def build_index(corpus: Corpus, db_path: str | Path, progress=None) -> Path:
    """Write the FTS5 index of `corpus` to `db_path` (atomically: a temp file renamed at the end)."""
    db_path = Path(db_path)
    tmp = db_path.with_suffix(f".tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    try:
        con.execute("CREATE VIRTUAL TABLE pages USING fts5(path UNINDEXED, title, body, "
                    "tokenize = 'unicode61 remove_diacritics 2')")
        rows = []
        for path in corpus.paths():
            title, body = plain_text(corpus.page(path).html)
            rows.append((path, title, body))
            if len(rows) >= 1000:
                con.executemany("INSERT INTO pages(path, title, body) VALUES (?, ?, ?)", rows)
                rows = []
            if progress is not None:
                progress.update(1)
        con.executemany("INSERT INTO pages(path, title, body) VALUES (?, ?, ?)", rows)
        con.execute("INSERT INTO pages(pages) VALUES ('optimize')")
        con.commit()
    finally:
        con.close()
    os.replace(tmp, db_path)
    return db_path


class SearchIndex:
    """Read-only BM25 search over an index written by `build_index`; safe to share across threads."""

    def __init__(self, db_path: str | Path):
        self.db_path = Path(db_path)
        if not self.db_path.is_file():
            raise FileNotFoundError(f"no search index at {self.db_path}")
        self._local = threading.local()

    def _con(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None:
            # immutable=1: the file never changes after the build, so SQLite skips locking entirely.
            con = sqlite3.connect(f"file:{self.db_path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
            self._local.con = con
        return con

    def search(self, query: str, k: int = 10) -> list[SearchHit]:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
            raise SearchError(f"k must be an integer between 1 and {MAX_K}, got {k!r}")
        terms = query_terms(query)
        if not terms:
            raise SearchError(f"query {query!r} has no searchable words")
        match = " OR ".join(f'"{t}"' for t in terms)
        # Rank first, then build snippets for the top k only: a snippet() in the ranking query is
        # computed for every matching row (~2,000 for a name + year on 10k pages), doubling the cost.
        # Ties are broken by rowid, i.e. corpus order, so results are deterministic.
        rows = self._con().execute(
            "WITH top AS (SELECT rowid AS r, bm25(pages, 0.0, ?, ?) AS s FROM pages WHERE pages MATCH ? "
            "ORDER BY s, rowid LIMIT ?) "
            "SELECT path, title, snippet(pages, 2, '', '', ' … ', 16), top.s FROM pages JOIN top ON pages.rowid = top.r "
            "WHERE pages MATCH ? ORDER BY top.s, top.r",
            (TITLE_WEIGHT, BODY_WEIGHT, match, k, match)).fetchall()
        return [SearchHit(rank=i + 1, path=p, title=t, snippet=" ".join(sn.split()), score=-s)
                for i, (p, t, sn, s) in enumerate(rows)]

    def num_docs(self) -> int:
        return self._con().execute("SELECT count(*) FROM pages").fetchone()[0]
