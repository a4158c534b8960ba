"""`browse-v0`: offline web research with search / open / find / answer, BrowseComp-style questions.

`BrowseDomain` is the `envs.base.Domain` of the browsing environment. Its tools are Python methods
that fetch from the process's shared local HTTP server (`server.shared_server`) — the agent gets
text back and never network access. The corpus behind it is any `Corpus`; by default the generated
web from `synth.py`, built once and cached (`build.load_or_build`).

Registered ids (see `register`):
  * ``browse-v0``       — the default corpus: 10,000 entity pages (+ list pages), seed 0.
  * ``browse-small-v0`` — 500 entity pages, same generator: for tests and quick smoke runs.

Grading (`check`) compares the one answer the agent gave with the task's private gold answer using
`grading.grade_answer` (normalised exact match, length cap, token F1 as a metric) and never looks at
page content, so prompt injections on pages can mislead an agent but cannot change a grade. The
hop count (pages on the evidence path) is reported as a metric so results can be split by it.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Mapping, Sequence

from envs.base import Domain, ToolEnv, ToolInvocation
from envs.browse.agent import Route, run_on_session
from envs.browse.build import BuiltCorpus, ensure_index, load_or_build
from envs.browse.corpus import Corpus, Question
from envs.browse.grading import grade_answer
from envs.browse.server import BrowseClient, BrowseServer, shared_server
from envs.browse.session import VIRTUAL_HOST, BrowseInputError, BrowseSession
from envs.tools import ToolArgError, tool
from jointrl.records import Limits, Message, Task
from rewards.rubric import Rubric, Term
from rewards.terms import check

DOMAIN = "browse"
DEFAULT_LIMITS = Limits(max_turns=16, tool_timeout_s=20.0, episode_timeout_s=300.0, max_obs_chars=4000)
SYSTEM_PROMPT = (
    "You are a research assistant with a web browser on an offline encyclopedia at http://" + VIRTUAL_HOST + "/. "
    "Tools: search(query, k) lists matching pages; open(url_or_id, cursor) opens a numbered link or result "
    "from what you last saw, or a URL, and shows a window of lines starting at `cursor`; find(pattern) lists "
    "lines of the open page containing the text. Names can be shared by several entries: check years. "
    "When you know the answer, call answer(text) with the short answer only; it ends the episode.")

_CORPUS_CACHE: dict[tuple, BuiltCorpus] = {}


def synthetic_corpus(pages: int, seed: int = 0) -> BuiltCorpus:
    """The generated corpus for (pages, seed), built on first use in this process or loaded from cache."""
    key = (pages, seed)
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE[key] = load_or_build(num_pages=pages, seed=seed)
    return _CORPUS_CACHE[key]


class BrowseDomain(Domain):
    """One browsing episode at a time (the framework makes one domain per env)."""

    rubric = Rubric(terms=(Term("correct", check("correct")),), truncated_reward=0.0, error_reward=0.0)

    def __init__(self, built: BuiltCorpus | None = None, *, pages: int = 10_000, seed: int = 0,
                 server: BrowseServer | None = None):
        self.built = built if built is not None else synthetic_corpus(pages, seed)
        # Default: the process-wide server for this corpus (a child process); tests may pass their own.
        self.server = server if server is not None else shared_server(self.built)
        self.session: BrowseSession | None = None
        self._answer: str | None = None
        self.nav_errors = 0

    @property
    def corpus(self) -> Corpus:
        return self.built.corpus

    def _client(self, timeout_s: float = 20.0) -> BrowseClient:
        return BrowseClient.for_server(self.server, timeout_s=timeout_s)

    def setup(self, task: Task) -> None:
        want = task.private.get("corpus")
        if want is not None and want != self.corpus.name:
            raise ValueError(f"task {task.id} was generated for corpus {want!r}, this env serves {self.corpus.name!r}")
        self.session = BrowseSession(self._client(task.limits.tool_timeout_s))
        self._answer = None
        self.nav_errors = 0

    def _s(self) -> BrowseSession:
        if self.session is None:
            raise RuntimeError("the browsing session is not set up (reset() first)")
        return self.session

    def _nav(self, fn: Callable[[], str]) -> str:
        try:
            return fn()
        except BrowseInputError as e:  # a wrong turn while browsing, not a malformed call
            self.nav_errors += 1
            return f"Error: {e}"

    # -- tools (the docstrings are what the model reads)
    @tool
    def search(self, query: str, k: int = 5) -> str:
        """Search the offline encyclopedia (BM25 full-text). Shows numbered results with URL and snippet.

        Args:
            query: words to search for, e.g. a name and a year
            k: how many results to show (1-20)
        """
        if not 1 <= k <= 20:
            raise ToolArgError(f"k must be between 1 and 20, got {k}")
        return self._nav(lambda: self._s().search(query, k))

    @tool
    def open(self, url_or_id: str | int | None = None, cursor: int = 0) -> str:
        """Open a page and show a window of its numbered lines; links appear as [text][n].

        Args:
            url_or_id: a link or result number from what you last saw (e.g. 3), or a URL such as http://browse.local/wiki/...; omit it to scroll the open page
            cursor: the line to start the window at (0 = top)
        """
        # `str | int`: models write open(3) as often as open("3"); both mean link 3 (a string of
        # digits is never a URL here), so neither is a malformed call. See BrowseSession.open.
        if cursor < 0:
            raise ToolArgError(f"cursor must be >= 0, got {cursor}")
        return self._nav(lambda: self._s().open(url_or_id, cursor))

    @tool
    def find(self, pattern: str) -> str:
        """List the lines of the open page (or search results) that contain `pattern` (case-insensitive).

        Args:
            pattern: plain text to look for, e.g. "Founded:"
        """
        return self._nav(lambda: self._s().find(pattern))

    @tool(ends_episode=True)
    def answer(self, text: str = "") -> str:
        """Give your final answer and end the episode. Write the short answer only (a name, a year, a value).

        Args:
            text: the answer
        """
        if self._answer is None:
            self._answer = text
        return "Answer recorded."

    # -- grading
    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        p = task.private
        g = grade_answer(self._answer, p["answer"], tuple(p.get("aliases", ())))
        s = self.session
        opened = set(s.pages_opened) if s else set()
        evidence = list(p["evidence"])
        hops = int(p["hops"])
        return {
            "correct": g.em,
            "f1": g.f1,
            "too_long": float(g.too_long),
            "answered": float(self._answer is not None),
            "hops": float(hops),
            f"correct_hops{hops}": g.em,  # per-hop accuracy: the mean over episodes that report it
            "evidence_recall": sum(e in opened for e in evidence) / len(evidence),
            "pages_opened": float(len(s.pages_opened) if s else 0),
            "searches": float(s.searches if s else 0),
            "nav_errors": float(self.nav_errors),
            "injected_path": float(bool(p.get("injected", False))),
        }

    def teardown(self) -> None:
        self.session = None  # the server is shared by every episode of the process and outlives this one

    # -- scripted policies for the conformance checker
    def reference(self, task: Task) -> list[ToolInvocation]:
        """Follow the recorded evidence path with the real tools (on a private session) and answer what the page says."""
        return run_on_session(BrowseSession(self._client()), Route.from_private(task.private))

    def noop(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("answer", {"text": ""})]


# ----------------------------------------------------------------------------- tasks and registration
def question_to_task(q: Question, corpus_name: str, limits: Limits = DEFAULT_LIMITS) -> Task:
    prompt = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=q.text))
    public = {"hops": q.hops, "answer_kind": q.answer_kind, "corpus": corpus_name}
    private = {"answer": q.answer, "aliases": list(q.aliases), "evidence": list(q.evidence),
               "relations": list(q.relations), "answer_field": q.answer_field, "hops": q.hops,
               "start_query": q.start_query, "candidates": list(q.candidates), "injected": q.injected,
               "corpus": corpus_name, "variant": q.evidence[0]}
    return Task(id=q.id, domain=DOMAIN, prompt=prompt, public=public, private=private, limits=limits,
                thinking="high", split=q.split)


def corpus_tasks(corpus: Corpus, split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    """Tasks of one split, shuffled by `seed`, the first `n` (all if None)."""
    qs: Sequence[Question] = [q for q in corpus.questions() if q.split == split]
    qs = sorted(qs, key=lambda q: q.id)
    random.Random(seed).shuffle(qs)
    if n is not None:
        qs = qs[:n]
    return [question_to_task(q, corpus.name) for q in qs]


def make_env(pages: int = 10_000, seed: int = 0, corpus: Corpus | None = None, **env_kw) -> ToolEnv:
    """A ToolEnv on the generated corpus (or on `corpus`, e.g. a DirectoryCorpus, indexed on first use)."""
    built = ensure_index(corpus) if corpus is not None else synthetic_corpus(pages, seed)
    return ToolEnv(BrowseDomain(built), **env_kw)


# Module-level factories, so that registering twice (tests, re-imports) is the documented no-op.
def make_browse_v0(**kw) -> ToolEnv:
    return make_env(pages=10_000, **kw)


def make_browse_small_v0(**kw) -> ToolEnv:
    return make_env(pages=500, **kw)


def tasks_browse_v0(split: str, seed: int, n: int | None) -> list[Task]:
    return corpus_tasks(synthetic_corpus(10_000).corpus, split, seed, n)


def tasks_browse_small_v0(split: str, seed: int, n: int | None) -> list[Task]:
    return corpus_tasks(synthetic_corpus(500).corpus, split, seed, n)


def register() -> None:
    """Register browse-v0 (10k pages) and browse-small-v0 (500 pages). Called by envs.builtin."""
    from envs.registry import register as reg

    files = sorted(Path(__file__).parent.glob("*.py"))
    what = "offline web research on a generated {} encyclopedia: search/open/find/answer, 1-4 hop questions"
    reg("browse-v0", make_browse_v0, tasks_browse_v0, source_files=files, description=what.format("10,000-page"))
    reg("browse-small-v0", make_browse_small_v0, tasks_browse_small_v0, source_files=files,
        description=what.format("500-page"))
