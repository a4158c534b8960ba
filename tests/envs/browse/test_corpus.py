"""The generated web: determinism, internal consistency, evidence paths, distractors, injections, plug-in corpora."""
from __future__ import annotations

import collections
import json
import re

import pytest

from envs.browse import synth
from envs.browse.build import load_or_build
from envs.browse.corpus import CorpusError, DirectoryCorpus, DiskCorpus, Question, check_path
from envs.browse.render import render_html

N = 500


@pytest.fixture(scope="module")
def world():
    return synth.generate(N, seed=0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return load_or_build(N, seed=0, cache_dir=tmp_path_factory.mktemp("cache"))


def test_generation_is_deterministic_and_seeded():
    a, b, c = synth.generate(200, seed=1), synth.generate(200, seed=1), synth.generate(200, seed=2)
    assert [(p.path, p.html) for p in a.pages] == [(p.path, p.html) for p in b.pages]
    assert [q.to_json() for q in a.questions] == [q.to_json() for q in b.questions]
    assert [p.html for p in a.pages] != [p.html for p in c.pages]


def test_default_build_has_at_least_10000_pages():
    w = synth.generate(10_000, seed=0)
    assert len(w.pages) >= 10_000
    assert len({p.path for p in w.pages}) == len(w.pages)
    kinds = collections.Counter(p.path.split("/")[1] or "home" for p in w.pages)
    assert kinds["wiki"] == 10_000 and kinds["list"] > 30 and kinds["disambiguation"] > 100


def test_too_small_corpus_is_refused():
    with pytest.raises(ValueError, match="num_pages"):
        synth.generate(10)


def test_graph_is_internally_consistent(world):
    ents = world.entities
    for e in ents:
        a = e.attrs
        if e.type == "country":
            cap = ents[a["capital"]]
            assert cap.type == "city" and cap.attrs["country"] == e.id, "a capital lies in its own country"
        # Causality: founders, creators and winners were adults (18+) at the time.
        if e.type == "organisation":
            assert ents[a["founder"]].attrs["born"] <= a["founded"] - 18, (e.name, "founder")
        if e.type == "work":
            assert ents[a["creator"]].attrs["born"] <= a["year"] - 18, (e.name, "creator")
        if e.type == "event":
            assert ents[a["winner"]].attrs["born"] <= a["year"] - 18, (e.name, "winner")
        for f in synth.SCHEMA[e.type]:
            if f.kind == "link":
                assert ents[a[f.name]].type == f.target, (e.type, f.name)


def test_near_miss_twins_share_name_and_type_but_not_year(world):
    ents = world.entities
    twins = [e for e in ents if e.twin_of is not None]
    assert len(twins) >= N * 0.05
    for t in twins:
        src = ents[t.twin_of]
        yf = synth.YEAR_FIELD[t.type]
        assert t.name == src.name and t.type == src.type and t.attrs[yf] != src.attrs[yf]
        assert t.path != src.path and t.title != src.title
    # (type, name, year) identifies an entity: what question descriptions rely on.
    keys = [(e.type, e.name, e.attrs[synth.YEAR_FIELD[e.type]]) for e in ents]
    assert len(set(keys)) == len(keys)


def _rows(page_html: str) -> dict[str, str]:
    r = render_html(page_html)
    out = {}
    for line in r.lines:
        m = re.match(r"^(\w+): (.+)$", line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    return out


def test_evidence_paths_are_real_link_chains_ending_at_the_answer(world):
    pages = {p.path: p for p in world.pages}
    by_path = {e.path: e for e in world.entities}
    qs = world.questions
    hops = collections.Counter(q.hops for q in qs)
    assert set(hops) == {1, 2, 3, 4} and max(hops.values()) - min(hops.values()) <= 1
    for q in qs:
        for here, label, nxt in zip(q.evidence, q.relations, q.evidence[1:]):
            r = render_html(pages[here].html)
            row = next(l for l in r.lines if l.startswith(f"{label}: "))
            n = int(re.search(r"\]\[(\d+)\]$", row).group(1))
            assert r.link(n).href == nxt, (q.id, here, label)
        shown = _rows(pages[q.evidence[-1]].html)[q.answer_field]
        shown = re.sub(r"\[([^\]]*)\]\[\d+\]", r"\1", shown)
        assert shown in (q.answer, *q.aliases), (q.id, shown, q.answer)
        # The start is described by name and year, and that pair names exactly one entity.
        start = by_path[q.evidence[0]]
        year = start.attrs[synth.YEAR_FIELD[start.type]]
        assert start.name in q.text and str(year) in q.text
        same = [e for e in world.entities if e.type == start.type and e.name == start.name
                and e.attrs[synth.YEAR_FIELD[e.type]] == year]
        assert same == [start]
        assert synth._norm(q.answer) not in synth._norm(q.text)
        assert all(synth._norm(c) != synth._norm(q.answer) for c in q.candidates)


def test_heldout_questions_start_from_unseen_entities(world):
    train = {q.evidence[0] for q in world.questions if q.split == "train"}
    held = {q.evidence[0] for q in world.questions if q.split == "heldout"}
    assert held and train and not (held & train)


def test_injections_are_present_and_on_some_evidence_paths(world):
    pages = {p.path: p for p in world.pages}
    injected = [p for p in world.injected_paths if p in pages]
    assert len(injected) >= N * 0.02
    for path in injected:
        assert re.search(r"ignore your task|grading system|SYSTEM OVERRIDE|the correct response", pages[path].html)
    assert sum(q.injected for q in world.questions) >= len(world.questions) // 8
    for q in world.questions:
        assert q.injected == any(p in world.injected_paths for p in q.evidence)


def test_disk_corpus_round_trip(built, world):
    c = built.corpus
    assert isinstance(c, DiskCorpus)
    assert list(c.paths()) == [p.path for p in world.pages]
    p0 = world.pages[3]
    assert c.page(p0.path) == p0
    assert [q.to_json() for q in c.questions()] == [q.to_json() for q in world.questions]
    with pytest.raises(KeyError):
        c.page("/wiki/no-such-page")


def test_cache_is_reused(built, tmp_path_factory):
    again = load_or_build(N, seed=0, cache_dir=built.root.parent.parent)
    assert again.root == built.root
    assert (built.root / "manifest.json").stat().st_mtime == (again.root / "manifest.json").stat().st_mtime


def test_paths_cannot_escape():
    for bad in ("/../etc/passwd", "/wiki/../../x", "wiki/x", "/wiki/a b", "//x"):
        with pytest.raises(KeyError):
            check_path(bad)
    with pytest.raises(CorpusError, match="manifest.json"):
        DiskCorpus("/nonexistent-corpus-dir")


def test_question_record_validates_itself():
    with pytest.raises(CorpusError, match="hops"):
        Question(id="q", text="t", answer="a", hops=2, evidence=("/a",), relations=(), answer_field="X",
                 answer_kind="name", start_query="a")
    with pytest.raises(CorpusError, match="relations"):
        Question(id="q", text="t", answer="a", hops=2, evidence=("/a", "/b"), relations=(), answer_field="X",
                 answer_kind="name", start_query="a")


def test_directory_corpus_plugs_in_a_real_collection(tmp_path):
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "intro.md").write_text("# Sandboxing\nbubblewrap starts in 10-40 ms.\n")
    (tmp_path / "page.html").write_text("<html><head><title>Ray notes</title></head><body><p>ray.init takes "
                                        "<a href=\"/doc/guide/intro.md\">about 3 s</a>.</p></body></html>")
    (tmp_path / "blob.bin").write_bytes(b"\0\1")
    q = Question(id="d-1", text="How long does bwrap take to start?", answer="10-40 ms", hops=2,
                 evidence=("/doc/page.html", "/doc/guide/intro.md"), relations=("ray.init takes",),
                 answer_field="bubblewrap starts in", answer_kind="value", start_query="ray notes")
    (tmp_path / "questions.jsonl").write_text(q.to_json() + "\n")
    c = DirectoryCorpus(tmp_path, name="notes")
    assert sorted(c.paths()) == ["/doc/guide/intro.md", "/doc/page.html"]
    assert c.page("/doc/guide/intro.md").title == "Sandboxing"
    assert "bubblewrap starts in 10-40 ms." in render_html(c.page("/doc/guide/intro.md").html).lines
    assert c.questions() == (q,)
    bad = Question(**{**json.loads(q.to_json()), "evidence": ("/doc/missing.md",), "hops": 1, "relations": ()})
    (tmp_path / "questions.jsonl").write_text(bad.to_json() + "\n")
    with pytest.raises(CorpusError, match="missing.md"):
        DirectoryCorpus(tmp_path)


def test_render_numbers_links_in_document_order():
    doc = ("<html><head><title>T</title><style>x{}</style></head><body><h1>T</h1><p>See <a href='/a'>A a</a> and "
           "<a href='/b'>B</a>.</p><!-- hidden --><table><tr><th>Born</th><td>1921</td></tr></table>"
           "<ul><li><a href='/c'>C</a></li></ul><script>evil()</script></body></html>")
    r = render_html(doc)
    assert r.title == "T"
    assert r.lines == ("T", "See [A a][1] and [B][2].", "Born: 1921", "* [C][3]")
    assert [(l.number, l.href, l.text) for l in r.links] == [(1, "/a", "A a"), (2, "/b", "B"), (3, "/c", "C")]
    with pytest.raises(IndexError):
        r.link(4)
