"""`browse-onehop-v0`: one-hop questions over the browse-small-v0 web, the first rung of the browse curriculum.

Each question asks for one infobox row of one entity named in the question with its year ("What is the
city of birth of the astronomer Gilmir Korithcal (born 1853)? Answer with a name only."), so one
`search`, one `open` of the right result and one `answer` solve it. Everything the agent touches is
browse-v0's: the generated corpus of browse-small-v0 (500 entity pages, seed 0, already cached by the
domain's tests and smoke runs), its HTTP server and BM25 index, and `BrowseDomain` itself, which this
rung wraps: the `search`, `open` and `answer` tools are `BrowseDomain`'s methods with their schemas, set-up
and the trusted grading (`BrowseDomain.check`: normalised exact match of the first `answer` against the
task's private gold answer) are its own. Only `find` is not offered (the asked row is always within the
first window of an entity page), so the prompt carries three tool schemas instead of four, and the
system prompt is a one-sentence version of browse-v0's.

Questions come from the generator's entity graph (`synth.generate`, the same seed, so the graph is the
one the cached pages were rendered from; the reference solution scoring 1 through the env checks it),
phrased as browse-v0 phrases its one-page questions. A question is dropped when its own text gives the
answer away (a person's occupation is part of how the person is named). Held-out questions are about
entities no train question is about: entities are split by hash (`envs.splits`, 25% held out), and
`Task.private["variant"]` names the entity. Near-miss twins (same name, another year) may fall on
different sides, which is the point: a name alone does not identify the entity, the year does.

Within a split each answer appears at most once per field (`MAX_PER_ANSWER`), so answering a field's
most common train answer without browsing is right on about one question per field at most
(docs/browse.md, "browse-onehop-v0", has the measured figure).

This module does not change browse-v0 or browse-small-v0: their corpora, questions and tasks are untouched.
"""
from __future__ import annotations

import functools
import hashlib
import random
from pathlib import Path
from typing import Callable, Mapping

from envs.base import Domain, ToolEnv, ToolInvocation
from envs.browse.agent import EvidenceFollower, ReferenceAgentError, Route
from envs.browse.build import synth_key
from envs.browse.corpus import Question
from envs.browse.domain import DOMAIN, BrowseDomain, synthetic_corpus
from envs.browse.grading import normalize_answer
from envs.browse.server import BrowseClient
from envs.browse.session import BrowseInputError, BrowseSession
from envs.browse.synth import SCHEMA, YEAR_FIELD, Entity, FieldSpec, _answer_text, _describe, _norm, generate
from envs.splits import split_by_hash, variant_key
from jointrl.records import Limits, Message, Task

ENV_ID = "browse-onehop-v0"
FAMILY = "browse-onehop"  # the family name in variant keys and in the hash that splits entities
PAGES, SEED = 500, 0  # browse-small-v0's corpus
HELDOUT_FRACTION = 0.25
MAX_PER_ANSWER = 1  # questions per (split, field, normalised answer)
SEARCH_K = 3  # results the reference asks for: the entity page is the top hit of "name year" for all 500
TOOLS = ("search", "open", "answer")
# Three calls solve a task; two more turns leave room for one wrong step and its correction.
LIMITS = Limits(max_turns=5, tool_timeout_s=10.0, episode_timeout_s=60.0, max_obs_chars=1500, max_arg_chars=1000)
SYSTEM_PROMPT = ("You have a browser on an offline encyclopedia. Search for the entry the question names, with its "
                 "year, open it, and call answer with the value the question asks for, nothing else.")
_HINT = {"year": "a year", "number": "a number", "value": "one word or short phrase", "name": "a name"}
_KIND = {"year": "year", "number": "number", "value": "value", "link": "name"}


# ----------------------------------------------------------------------------- questions
def _question(e: Entity, f: FieldSpec, ents: list[Entity], split: str, injected: bool) -> Question | None:
    """The one-hop question about row `f` of `e`, or None when the question's text gives the answer away."""
    answer = _answer_text(e, f, ents)
    text = f"What is the {f.phrase} of {_describe(e)}?"
    if _norm(answer) in _norm(text):
        return None
    kind = _KIND[f.kind]
    aliases: tuple[str, ...] = ()
    if kind == "number":
        aliases = (answer.replace(",", ""),)
    elif kind == "name" and ents[e.attrs[f.name]].title != answer:
        aliases = (ents[e.attrs[f.name]].title,)  # a shared name shown with its disambiguator is also right
    # Plausible wrong answers (for the stuffing tests): the same row of same-type entities, twins first.
    same = sorted((o for o in ents if o.type == e.type and o.id != e.id), key=lambda o: (o.name != e.name, o.id))
    cands: list[str] = []
    for o in same:
        c = _answer_text(o, f, ents)
        if _norm(c) != _norm(answer) and c not in cands:
            cands.append(c)
        if len(cands) == 10:
            break
    slug = e.path.rsplit("/", 1)[-1]
    year = e.attrs[YEAR_FIELD[e.type]]
    return Question(id=f"{ENV_ID}/{split}/{slug}/{f.name}", text=f"{text} Answer with {_HINT[kind]} only.",
                    answer=answer, hops=1, evidence=(e.path,), relations=(), answer_field=f.label, answer_kind=kind,
                    start_query=f"{e.name} {year}", aliases=aliases, candidates=tuple(cands), injected=injected,
                    split=split)


@functools.lru_cache(maxsize=1)
def question_pool() -> Mapping[str, tuple[Question, ...]]:
    """Every one-hop question of the rung by split, in a fixed order (independent of any task seed)."""
    world = generate(PAGES, SEED)
    ents = world.entities
    held = {v[0] for v in split_by_hash(FAMILY, [(e.path,) for e in ents], HELDOUT_FRACTION)["heldout"]}
    rows = [(e, f) for e in ents for f in SCHEMA[e.type] if f.kind != "year"]  # the year is in the question
    # The answer cap keeps the first question of each (split, field, answer) in this order: a hash,
    # so which entity keeps a shared answer does not depend on names or generation order.
    rows.sort(key=lambda r: hashlib.sha256(f"{FAMILY}:{r[0].path}:{r[1].name}".encode()).hexdigest())
    pool: dict[str, list[Question]] = {"train": [], "heldout": []}
    used: dict[tuple[str, str, str], int] = {}
    for e, f in rows:
        split = "heldout" if e.path in held else "train"
        q = _question(e, f, ents, split, e.path in world.injected_paths)
        if q is None:
            continue
        key = (split, q.answer_field, normalize_answer(q.answer))
        if used.get(key, 0) >= MAX_PER_ANSWER:
            continue
        used[key] = used.get(key, 0) + 1
        pool[split].append(q)
    return {s: tuple(qs) for s, qs in pool.items()}


@functools.lru_cache(maxsize=1)
def corpus_name() -> str:
    """The name of browse-small-v0's cached corpus (`BrowseDomain.setup` refuses tasks of another corpus)."""
    return synth_key(PAGES, SEED, None)


def to_task(q: Question) -> Task:
    corpus = corpus_name()
    public = {"hops": 1, "answer_kind": q.answer_kind, "field": q.answer_field, "corpus": corpus}
    private = {"answer": q.answer, "aliases": list(q.aliases), "evidence": list(q.evidence), "relations": [],
               "answer_field": q.answer_field, "hops": 1, "start_query": q.start_query,
               "candidates": list(q.candidates), "injected": q.injected, "corpus": corpus,
               "variant": variant_key(FAMILY, q.evidence)}
    prompt = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=q.text))
    return Task(id=q.id, domain=DOMAIN, prompt=prompt, public=public, private=private, limits=LIMITS,
                thinking="low", split=q.split)


def make_tasks(split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    """`n` tasks of `split` (all of them if None), in an order shuffled by `seed`."""
    pool = question_pool().get(split)
    if pool is None:
        raise ValueError(f"unknown split {split!r}; splits are: train, heldout")
    if n is not None and not 0 <= n <= len(pool):
        raise ValueError(f"{ENV_ID} has {len(pool)} {split} tasks; asked for {n}")
    qs = list(pool)
    random.Random(f"{ENV_ID}:{seed}:{split}").shuffle(qs)
    return [to_task(q) for q in qs[:n]]


# ----------------------------------------------------------------------------- the domain
def _reuse(name: str) -> Callable:
    """`BrowseDomain`'s tool `name`, run on the wrapped domain: the same code and schema (the tool spec
    travels with `functools.wraps`, which copies the function's attributes)."""
    inner = getattr(BrowseDomain, name)

    @functools.wraps(inner)
    def call(self: "OneHopDomain", *args, **kwargs):
        return inner(self.browse, *args, **kwargs)

    return call


class OneHopDomain(Domain):
    """browse-v0's `BrowseDomain` behind three of its tools; set-up, grading and rubric are the wrapped domain's."""

    rubric = BrowseDomain.rubric

    def __init__(self, browse: BrowseDomain):
        self.browse = browse

    search = _reuse("search")
    open = _reuse("open")
    answer = _reuse("answer")

    def setup(self, task: Task) -> None:
        self.browse.setup(task)

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        return self.browse.check(task, transcript)

    def before_grade(self) -> None:
        self.browse.before_grade()

    def teardown(self) -> None:
        self.browse.teardown()

    def reference(self, task: Task) -> list[ToolInvocation]:
        """search(name year, k=3) -> open(the result whose URL is the entity's page) -> answer(what its row says),
        on a private session; each step is read from the tool output, as browse-v0's reference does."""
        session = BrowseSession(BrowseClient.for_server(self.browse.server, timeout_s=task.limits.tool_timeout_s))
        agent = EvidenceFollower(Route.from_private(task.private), k=SEARCH_K)
        calls: list[ToolInvocation] = []
        obs: str | None = None
        while not calls or calls[-1].name != "answer":
            inv = agent.act(obs)
            if inv.name not in TOOLS or len(calls) == len(TOOLS):
                raise ReferenceAgentError(f"{task.id}: the reference needed {inv.name}, not search / open / answer")
            calls.append(inv)
            if inv.name != "answer":
                args = {("target" if k == "url_or_id" else k): v for k, v in inv.arguments.items()}
                try:
                    obs = getattr(session, inv.name)(**args)
                except BrowseInputError as e:
                    raise ReferenceAgentError(f"{task.id}: {inv.name}{dict(inv.arguments)} failed: {e}") from e
        return calls

    def noop(self, task: Task) -> list[ToolInvocation]:
        return self.browse.noop(task)


def make_env(**env_kw) -> ToolEnv:
    """`envs.make("browse-onehop-v0", limits=..., max_calls_per_turn=...)`: a ToolEnv on browse-small-v0's corpus."""
    return ToolEnv(OneHopDomain(BrowseDomain(synthetic_corpus(PAGES, SEED))), **env_kw)


def register() -> None:
    """Register browse-onehop-v0 (called by envs.browse.register, next to browse-v0)."""
    from envs.registry import register as reg

    reg(ENV_ID, make_env, make_tasks, source_files=sorted(Path(__file__).parent.glob("*.py")),
        description="one-hop questions (one infobox row of one named entity) on browse-small-v0's web: "
                    "search/open/answer, the first rung of the browse curriculum")
