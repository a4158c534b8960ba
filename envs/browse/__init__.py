"""The browsing domain (`browse-v0`): an offline, generated web served over loopback HTTP, BM25 search,
search/open/find/answer tools, multi-hop questions with recorded evidence paths. See docs/browse.md.

Modules: corpus (records, Corpus protocol, on-disk corpora), synth (the generator), build (cache),
index (FTS5 BM25), server (HTTP server + client), render (HTML -> numbered-link text), session (the
agent's browser), grading (EM / F1 / length cap), agent (scripted reference), domain (Env wiring),
onehop (browse-onehop-v0: one-hop questions on the same domain, the first rung of its curriculum).
"""
from envs.browse.corpus import Corpus, DirectoryCorpus, DiskCorpus, Page, Question


def register() -> None:
    """Entry point for envs.builtin: registers browse-v0, browse-small-v0 and the rung browse-onehop-v0."""
    from envs.browse.domain import register as _register
    from envs.browse.onehop import register as _register_onehop

    _register()
    _register_onehop()


__all__ = ["Corpus", "DirectoryCorpus", "DiskCorpus", "Page", "Question", "register"]
