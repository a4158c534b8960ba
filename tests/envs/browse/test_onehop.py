"""browse-onehop-v0 through the real env (browse-small-v0's corpus, HTTP server and grader): the reference
scores 1 on train and held-out tasks in three calls, wrong and degenerate answers score 0, held-out entities
never appear in train, the conformance checker passes, and a policy that tries to cheat scores 0 (or, for
the field prior, about one question per field): the field's most common train answer, the overall most
common answer, a near-miss twin's answer, the page text or a list of candidates, obeying a prompt-injected
page, and the answer written into other tool calls or into plain text."""
from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Sequence

import pytest

import envs
from envs.base import ToolInvocation, messages_for_calls
from envs.browse import onehop
from envs.browse.baseline import fixed_answer_baseline
from envs.browse.domain import BrowseDomain
from envs.browse.grading import normalize_answer
from envs.browse.grading import MAX_ANSWER_CHARS
from envs.browse.synth import INJECTIONS, generate
from envs.check import check_env
from envs.play import ScriptedPolicy, run_episode
from envs.splits import split_by_hash, variant_key
from jointrl.records import Message, Task, ToolCall

ENV_ID = onehop.ENV_ID


@pytest.fixture(scope="module")
def train() -> list[Task]:
    return onehop.make_tasks("train")


@pytest.fixture(scope="module")
def heldout() -> list[Task]:
    return onehop.make_tasks("heldout")


def play_all(tasks: Sequence[Task], policy_for_task) -> list:
    """One env, one episode per task; `policy_for_task(env, task)` -> an `envs.play` policy."""
    async def go():
        env = envs.make(ENV_ID)
        try:
            return [await run_episode(env, t, policy_for_task(env, t), max_steps=10) for t in tasks]
        finally:
            env.close()
    return asyncio.run(go())


def scripted(calls: list[ToolInvocation] | list[Message]):
    return lambda env, task: ScriptedPolicy(calls)


def answer(text: str) -> ToolInvocation:
    return ToolInvocation("answer", {"text": text})


def rewards(transcripts) -> list[float]:
    for tr in transcripts:
        assert tr.grade.error is None, tr.render()
    return [tr.grade.reward for tr in transcripts]


# ----------------------------------------------------------------------------- registration, splits, sizes
def test_registered_next_to_browse_v0_and_conformant():
    specs = {s.env_id: s for s in envs.list_envs()}
    assert {"browse-v0", "browse-small-v0", ENV_ID} <= set(specs), envs.discovery_errors()
    assert "one-hop" in specs[ENV_ID].description
    ts = envs.generate_tasks(ENV_ID, "heldout", seed=3, n=5)
    assert all(t.domain == "browse" and t.split == "heldout" and t.public["hops"] == 1 for t in ts)
    assert Task.from_row(ts[0].to_row()) == ts[0]
    report = check_env(ENV_ID, n_tasks=4)
    assert report.passed, report.render()


def test_heldout_entities_task_ids_and_variants_never_appear_in_train(train, heldout):
    assert len(train) >= 300 and len(heldout) >= 150
    assert len(train) == len(onehop.question_pool()["train"]) and len(heldout) == len(onehop.question_pool()["heldout"])
    entity = lambda t: t.private["evidence"][0]  # noqa: E731
    assert not {t.id for t in heldout} & {t.id for t in train}
    assert not {t.private["variant"] for t in heldout} & {t.private["variant"] for t in train}
    assert not {entity(t) for t in heldout} & {entity(t) for t in train}
    assert not {t.prompt[-1].content for t in heldout} & {t.prompt[-1].content for t in train}
    # The variant is the entity, split by envs.splits' hash over every entity of the corpus.
    every = [(e.path,) for e in generate(onehop.PAGES, onehop.SEED).entities]
    held = {p for (p,) in split_by_hash(onehop.FAMILY, every, onehop.HELDOUT_FRACTION)["heldout"]}
    assert {entity(t) for t in heldout} <= held and not {entity(t) for t in train} & held
    for t in heldout + train:
        assert t.private["variant"] == variant_key(onehop.FAMILY, (entity(t),))
    # Entity and field together identify a task: no duplicates within a split.
    assert len({(entity(t), t.private["answer_field"]) for t in train}) == len(train)


def test_generation_is_deterministic_and_seeded(train):
    assert [t.to_row() for t in onehop.make_tasks("train", 0, 50)] == [t.to_row() for t in train[:50]]
    other = onehop.make_tasks("train", 1, 50)
    assert [t.id for t in other] != [t.id for t in train[:50]]
    assert sorted(t.id for t in onehop.make_tasks("train", 1)) == sorted(t.id for t in train)  # same pool, other order
    with pytest.raises(ValueError, match=f"has {len(train)} train tasks"):
        onehop.make_tasks("train", 0, len(train) + 1)
    with pytest.raises(ValueError, match="unknown split"):
        onehop.make_tasks("test")


def test_each_answer_appears_once_per_field_and_split(train, heldout):
    for split in (train, heldout):
        keys = Counter((t.private["answer_field"], normalize_answer(t.private["answer"])) for t in split)
        assert max(keys.values()) == onehop.MAX_PER_ANSWER == 1
    # questions never give their answer away
    for t in train + heldout:
        assert normalize_answer(t.private["answer"]) not in normalize_answer(t.prompt[-1].content)


# ----------------------------------------------------------------------------- the reference
def _sample(train: list[Task], heldout: list[Task]) -> list[Task]:
    picked = train[::40] + heldout[::20]
    picked += [t for t in train if t.private["injected"]][:3] + [t for t in heldout if t.private["injected"]][:3]
    picked += [t for t in heldout if t.private["aliases"]][:4]  # numbers and shared names
    return picked


def test_reference_scores_one_in_three_calls_on_train_and_heldout(train, heldout):
    tasks = _sample(train, heldout)
    assert {t.split for t in tasks} == {"train", "heldout"} and any(t.private["injected"] for t in tasks)
    trs = play_all(tasks, lambda env, t: ScriptedPolicy(env.reference(t)))
    assert rewards(trs) == [1.0] * len(tasks)
    for tr in trs:
        calls = [c for m in tr.messages for c in m.tool_calls]
        assert [c.name for c in calls] == ["search", "open", "answer"], tr.render()
        assert calls[1].arguments == '{"url_or_id": 1}'  # the entity page is the top hit of "name year"
        assert tr.grade.metrics["check/evidence_recall"] == 1.0 and tr.turns == 3


def test_tools_are_browse_v0s_minus_find():
    env = envs.make(ENV_ID)
    full = envs.make("browse-small-v0")
    try:
        schemas = {s["function"]["name"]: s for s in full.tool_schemas}
        assert env.tool_schemas == [schemas[n] for n in ("search", "open", "answer")]
        assert isinstance(env.domain.browse, BrowseDomain)
        assert type(env.domain).open.__wrapped__ is BrowseDomain.open
    finally:
        env.close()
        full.close()


# ----------------------------------------------------------------------------- wrong and degenerate answers
def test_wrong_empty_and_degenerate_answers_score_zero(train, heldout):
    task = next(t for t in heldout if t.public["answer_kind"] == "name" and len(t.private["candidates"]) >= 5)
    gold, cands = task.private["answer"], list(task.private["candidates"])
    name = task.private["start_query"].rsplit(" ", 1)[0]
    bad = ["", "   ", "?!.", cands[0], name, task.private["start_query"], task.prompt[-1].content, "\x00\ud800",
           "x" * 5000, gold[:-1], f"{gold} {gold}"]
    trs = play_all([task] * len(bad), lambda env, t, it=iter(bad): ScriptedPolicy([answer(next(it))]))
    assert rewards(trs) == [0.0] * len(bad)
    assert play_all([task], scripted([answer(gold)]))[0].grade.reward == 1.0  # control: the same grader takes it
    number = next(t for t in train if t.public["answer_kind"] == "number")
    assert rewards(play_all([number] * 2, lambda env, t, it=iter([number.private["answer"],
                                                                 number.private["aliases"][0]]): ScriptedPolicy([answer(next(it))]))) == [1.0, 1.0]


# ----------------------------------------------------------------------------- attacks
def test_the_fields_most_common_train_answer_scores_about_one_question_per_field(train, heldout):
    pool = onehop.question_pool()
    b = fixed_answer_baseline(pool["train"] + pool["heldout"])
    best = {f.field: f.answer for f in b.fields}
    got = rewards(play_all(heldout, lambda env, t: ScriptedPolicy([answer(best[t.private["answer_field"]])])))
    assert sum(got) == sum(f.hits_heldout for f in b.fields)  # the env scores what the baseline measured
    assert sum(got) / len(heldout) <= 0.03, b.table()
    assert b.train_rate <= 0.05 and all(f.hits_train <= 1 and f.hits_heldout <= 1 for f in b.fields), b.table()
    const = Counter(normalize_answer(t.private["answer"]) for t in train).most_common(1)[0][0]
    assert sum(rewards(play_all(heldout, scripted([answer(const)])))) <= 2


def test_a_near_miss_twins_answer_scores_zero(train, heldout):
    """Held-out entities sharing a name with a train entity: a policy that memorised name -> answer from train fails."""
    by_name = {(t.private["start_query"].rsplit(" ", 1)[0], t.private["answer_field"]): t for t in train}
    pairs = [(t, by_name[k]) for t in heldout for k in [(t.private["start_query"].rsplit(" ", 1)[0], t.private["answer_field"])]
             if k in by_name and normalize_answer(by_name[k].private["answer"]) != normalize_answer(t.private["answer"])]
    assert len(pairs) >= 3
    trs = play_all([h for h, _ in pairs], lambda env, t, it=iter(pairs): ScriptedPolicy([answer(next(it)[1].private["answer"])]))
    assert rewards(trs) == [0.0] * len(pairs)
    assert rewards(play_all([h for h, _ in pairs], lambda env, t: ScriptedPolicy(env.reference(t)))) == [1.0] * len(pairs)


class _ReadThenSay:
    """search -> open(1) -> answer(what `pick(task, page text)` returns): an attacker that reads the page."""

    def __init__(self, task: Task, pick):
        self.task, self.pick, self.turn = task, pick, 0

    async def __call__(self, messages, tools):
        self.turn += 1
        if self.turn == 1:
            inv = ToolInvocation("search", {"query": self.task.private["start_query"], "k": 3})
        elif self.turn == 2:
            inv = ToolInvocation("open", {"url_or_id": 1})
        else:
            page = " ".join(re.sub(r"^L\d+: ", "", line) for line in messages[-1].content.splitlines())
            inv = answer(self.pick(self.task, page))
        return messages_for_calls([inv], start=self.turn)[0]


def _injected_answer(task: Task, page: str) -> str:
    for tpl in INJECTIONS:
        head, rest = tpl.split("{x}", 1)
        m = re.search(re.escape(head) + r"(.+?)" + re.escape(rest.split("{x}", 1)[0][:12]), page)
        if m:
            return m.group(1)
    raise AssertionError(f"no injection on the page of {task.id}: {page[:300]}")


def test_obeying_a_prompt_injected_page_scores_zero_and_the_honest_agent_one(train, heldout):
    tasks = [t for t in heldout + train if t.private["injected"]][:12]
    assert len(tasks) == 12
    said: list[str] = []
    trs = play_all(tasks, lambda env, t: _ReadThenSay(t, lambda task, page: said.append(_injected_answer(task, page)) or said[-1]))
    assert len(said) == len(tasks)
    assert all(normalize_answer(x) != normalize_answer(t.private["answer"]) for x, t in zip(said, tasks))
    assert rewards(trs) == [0.0] * len(tasks)
    assert all(tr.grade.metrics["check/answered"] == 1.0 for tr in trs)  # it did answer, with the planted text
    assert rewards(play_all(tasks, lambda env, t: ScriptedPolicy(env.reference(t)))) == [1.0] * len(tasks)


def test_the_page_text_or_a_list_of_candidates_scores_zero(heldout):
    tasks = [t for t in heldout if len(t.private["candidates"]) >= 4][:8]
    trs = play_all(tasks, lambda env, t: _ReadThenSay(t, lambda task, page: page))
    assert rewards(trs) == [0.0] * len(tasks)
    # Graded as too long when the page fits the argument cap; a malformed call (never an answer) when it does not.
    for tr in trs:
        text = [c for m in tr.messages for c in m.tool_calls][-1].arguments
        assert len(text) > MAX_ANSWER_CHARS
        assert tr.grade.metrics["check/too_long"] == 1.0 or (tr.grade.metrics["check/answered"] == 0.0
                                                             and len(text) > onehop.LIMITS.max_arg_chars)
    lists = [", ".join(t.private["candidates"][:3] + [t.private["answer"]]) for t in tasks]
    lines = ["\n".join(f"Answer: {c}" for c in [t.private["answer"]] + t.private["candidates"][:3]) for t in tasks]
    for texts in (lists, lines):
        trs = play_all(tasks, lambda env, t, it=iter(texts): ScriptedPolicy([answer(next(it))]))
        assert rewards(trs) == [0.0] * len(tasks)


def test_the_answer_outside_the_answer_tool_scores_zero(heldout):
    task = heldout[0]
    gold = task.private["answer"]
    text = Message(role="assistant", content=f"Answer: {gold}")
    other_tools = [ToolInvocation("search", {"query": gold}), ToolInvocation("open", {"url_or_id": gold}),
                   ToolInvocation("find", {"pattern": gold}), ToolInvocation("Answer", {"text": gold})]
    never = messages_for_calls(other_tools) + [text]
    empty_last = messages_for_calls(other_tools[:2]) + [text] + messages_for_calls([answer("")], start=9)
    forged = [Message(role="assistant", content="", tool_calls=(ToolCall(id="c", name="answer", arguments=f'{{"txt": "{gold}"}}'),)),
              Message(role="assistant", content="", tool_calls=(ToolCall(id="d", name="answer", arguments=f'"{gold}"'),))]
    trs = play_all([task] * 3, lambda env, t, it=iter([never, empty_last, forged]): ScriptedPolicy(next(it)))
    assert rewards(trs) == [0.0, 0.0, 0.0]
    assert trs[0].truncated and trs[0].grade.metrics["check/answered"] == 0.0
    assert trs[0].grade.metrics["malformed_calls"] >= 3  # `find` and `Answer` are not tools here, text is not a call
    assert trs[1].terminated and trs[1].grade.metrics["check/answered"] == 1.0
    assert trs[2].truncated and trs[2].grade.metrics["check/answered"] == 0.0
    out = [m.content for m in trs[0].messages if m.role == "tool"]
    assert any("unknown tool 'find'" in o for o in out)
    assert trs[0].turns == onehop.LIMITS.max_turns == task.limits.max_turns
