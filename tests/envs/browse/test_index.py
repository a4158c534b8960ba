"""BM25 search: FTS5's scores against a from-the-formula reference, ranking quality, input errors."""
from __future__ import annotations

import math
import re

import pytest

from envs.browse.build import load_or_build
from envs.browse.corpus import Page
from envs.browse.index import BODY_WEIGHT, TITLE_WEIGHT, SearchError, SearchIndex, build_index, plain_text, query_terms


class ListCorpus:
    """The smallest Corpus: a list of pages (also shows the protocol is all the index needs)."""

    def __init__(self, pages: list[Page]):
        self.name, self._pages = "list", {p.path: p for p in pages}

    def paths(self):
        return list(self._pages)

    def page(self, path):
        return self._pages[path]

    def questions(self):
        return ()


def _page(path: str, title: str, body: str) -> Page:
    return Page(path, title, f"<html><head><title>{title}</title></head><body><p>{body}</p></body></html>")


def _tokens(text: str) -> list[str]:
    # FTS5 unicode61 on ASCII text: lower-case runs of letters and digits.
    return re.findall(r"[a-z0-9]+", text.lower())


def reference_bm25(docs: dict[str, tuple[str, str]], query: str, k1: float = 1.2, b: float = 0.75) -> dict[str, float]:
    """Okapi BM25 as FTS5 documents it, written out slowly: weighted term frequency over (title, body),
    document length = tokens in all columns, idf = ln((N - n + 0.5) / (n + 0.5)) floored at 1e-6."""
    terms = query_terms(query)
    toks = {p: (_tokens(t), _tokens(bd)) for p, (t, bd) in docs.items()}
    n_docs = len(docs)
    avgdl = sum(len(t) + len(bd) for t, bd in toks.values()) / n_docs
    scores: dict[str, float] = {}
    for p, (t, bd) in toks.items():
        dl = len(t) + len(bd)
        s, hit = 0.0, False
        for term in terms:
            n_hit = sum(1 for tt, bb in toks.values() if term in tt or term in bb)
            idf = math.log((n_docs - n_hit + 0.5) / (n_hit + 0.5))
            idf = idf if idf > 0 else 1e-6
            f = TITLE_WEIGHT * t.count(term) + BODY_WEIGHT * bd.count(term)
            if f:
                hit = True
            s += idf * f * (k1 + 1) / (f + k1 * (1 - b + b * dl / avgdl))
        if hit:
            scores[p] = s
    return scores


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    pages = [
        _page("/a", "Glass River", "Glass River is a novel by Alder Voss published in 1987."),
        _page("/b", "Glass River (film)", "A film about a river made of glass glass glass."),
        _page("/c", "Alder Voss", "Alder Voss was a painter born in Tarsk in 1921, who never wrote about rivers."),
        _page("/d", "Tarsk", "Tarsk is a city. Its mayor is Brin Tal. The river Tarsk flows through it."),
        _page("/e", "Unrelated", "Nothing to see here; this page is about ceramics and shipping."),
    ] + [_page(f"/f{i}", f"Filler {i}", f"filler text number {i} about other things entirely") for i in range(20)]
    corpus = ListCorpus(pages)
    db = build_index(corpus, tmp_path_factory.mktemp("idx") / "index.sqlite")
    docs = {p: plain_text(corpus.page(p).html) for p in corpus.paths()}
    return SearchIndex(db), docs


@pytest.mark.parametrize("query", ["glass river", "Alder Voss 1921", "tarsk river mayor", "ceramics", "river",
                                   "filler 7 glass"])
def test_fts5_bm25_matches_reference_formula(small_index, query):
    index, docs = small_index
    ref = reference_bm25(docs, query)
    hits = index.search(query, k=50)
    assert {h.path for h in hits} == set(ref)
    for h in hits:
        assert h.score == pytest.approx(ref[h.path], rel=1e-6, abs=1e-9), h.path
    order = list(docs)  # ties are broken by corpus order
    ranked = sorted(ref, key=lambda p: (-ref[p], order.index(p)))
    assert [h.path for h in hits] == ranked


def test_search_hits_carry_title_snippet_and_rank(small_index):
    index, _ = small_index
    hits = index.search("glass river", k=2)
    assert [h.rank for h in hits] == [1, 2]
    assert {h.path for h in hits} == {"/a", "/b"}
    assert all(h.title.startswith("Glass River") and "lass" in h.snippet.lower() for h in hits)


def test_bad_queries_are_refused_clearly(small_index):
    index, _ = small_index
    with pytest.raises(SearchError, match="no searchable words"):
        index.search("  ?! ", 5)
    for k in (0, 51, True, 2.5):
        with pytest.raises(SearchError, match="k must be"):
            index.search("glass", k)
    # FTS5 syntax in the query is just words, never an FTS5 expression.
    assert index.search('glass" OR NEAR(river', 5)[0].path in ("/a", "/b")


def test_search_finds_the_start_of_almost_every_question(tmp_path_factory):
    built = load_or_build(500, seed=0, cache_dir=tmp_path_factory.mktemp("cache"))
    index = SearchIndex(built.index_path)
    qs = built.corpus.questions()
    at1 = at10 = 0
    for q in qs:
        paths = [h.path for h in index.search(q.start_query, 10)]
        at1 += paths[:1] == [q.evidence[0]]
        at10 += q.evidence[0] in paths
    # Name + year: the right page should lead; near-miss twins share the name, the year decides.
    assert at10 / len(qs) >= 0.95 and at1 / len(qs) >= 0.8, (at1, at10, len(qs))
