"""Registry, entry-point discovery, task sets as cached HF datasets."""
from __future__ import annotations

import importlib.metadata

import pytest

import envs
from envs import registry
from jointrl.records import Message, Task


def _tasks(split, seed, n):
    n = 3 if n is None else n
    return [Task(id=f"toy/{split}/{seed}/{i}", domain="toy", prompt=(Message(role="user", content=f"{seed}-{i}"),),
                 private={"variant": f"{split}{i}"}, split=split) for i in range(n)]


def _factory(**kw):
    raise AssertionError("not built in these tests")


@pytest.fixture
def toy_id():
    env_id = "toy-registry-v0"
    registry.register(env_id, _factory, _tasks)
    yield env_id
    registry._REGISTRY.pop(env_id, None)


def test_builtin_entry_point_is_declared_and_discovered():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="jointrl.envs")}
    assert eps.get("builtin") == "envs.builtin:register_all"
    assert "terminal-v0" in [s.env_id for s in envs.list_envs()]


def test_register_validates_ids_and_refuses_duplicates(toy_id):
    assert registry.register(toy_id, _factory, _tasks).env_id == toy_id  # same callables: a no-op
    with pytest.raises(ValueError, match="already registered.*toy-registry-v1"):
        registry.register(toy_id, lambda **kw: None, _tasks)
    for bad in ("Toy-v0", "toy", "toy-v", "toy_v0"):
        with pytest.raises(ValueError, match="must look like"):
            registry.register(bad, _factory, _tasks)


def test_unknown_ids_and_splits_are_named_in_errors(toy_id):
    with pytest.raises(KeyError, match="unknown env id 'nope-v0'; registered: .*terminal-v0"):
        envs.make("nope-v0")
    with pytest.raises(ValueError, match="unknown split 'test'; splits are: train, heldout"):
        envs.generate_tasks(toy_id, "test")


def test_a_broken_plugin_is_skipped_and_reported(monkeypatch):
    class EP:
        name, value = "broken", "nowhere:register"

        def load(self):
            raise ImportError("no module named nowhere")

    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.setattr(registry, "_DISCOVERY_ERRORS", {})
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [EP()])
    registry._discover()
    assert "nowhere" in registry.discovery_errors()["broken"]


def test_builtin_skips_domains_with_missing_optional_dependencies(monkeypatch):
    from envs import builtin

    monkeypatch.setattr(builtin, "SKIPPED", {})
    builtin._try("ghost", "some_uninstalled_dep_xyz:register")
    builtin._try("buggy", "envs.no_such_module_xyz:register")
    assert builtin.SKIPPED["ghost"].startswith("optional dependency missing")
    assert builtin.SKIPPED["buggy"].startswith("error")


def test_tasks_are_a_cached_deterministic_dataset(toy_id, tmp_path, monkeypatch):
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    ds = envs.tasks(toy_id, "train", seed=7, n=4)
    assert len(ds) == 4 and set(ds.column_names) == {"id", "domain", "prompt", "public", "private", "limits", "thinking", "split"}
    assert Task.from_row(ds[2]) == _tasks("train", 7, 4)[2]
    cached = list((tmp_path / "envs" / toy_id).iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("train-seed7-n4-")
    again = envs.tasks(toy_id, "train", seed=7, n=4)
    assert again.to_list() == ds.to_list()
    assert envs.tasks(toy_id, "train", seed=8, n=4)[0]["id"] != ds[0]["id"]
    assert len(envs.tasks(toy_id, "heldout", seed=7, n=0)) == 0


def test_generator_output_is_validated(monkeypatch):
    env_id = "toy-bad-v0"
    registry.register(env_id, _factory, lambda split, seed, n: [_tasks("train", 0, 1)[0]] * 2)
    try:
        with pytest.raises(ValueError, match="duplicate task ids"):
            envs.generate_tasks(env_id, "train")
        with pytest.raises(ValueError, match="says split 'train'"):
            envs.generate_tasks(env_id, "heldout")
    finally:
        registry._REGISTRY.pop(env_id, None)


# --------------------------------------------------------------------------- envs.check: do-nothing, best constant
from envs import Domain, Limits, ToolInvocation, tool  # noqa: E402
from envs.base import ToolEnv  # noqa: E402
from envs.check import CONSTANT_LIMIT, check_env  # noqa: E402
from rewards import Rubric, Term, check  # noqa: E402


def _yes_no_tasks(split, seed, n):
    # Held-out answers are "yes" on 3 of 4 tasks: a prior a constant answer collects.
    n = 8 if n is None else n
    return [Task(id=f"yn/{split}/{seed}/{i}", domain="yn", split=split, limits=Limits(max_turns=3),
                 prompt=(Message(role="user", content=f"Is {seed * 100 + i} {split} even-ish? Answer yes or no."),),
                 private={"answer": "no" if i % 4 == 0 else "yes", "variant": f"{split}{seed}-{i}"}) for i in range(n)]


class _YesNo(Domain):
    rubric = Rubric((Term("correct", check("correct"), 1.0),))
    empty_scores = 0.0  # what an empty answer earns (a broken grader pays for it)

    def setup(self, task):
        self.given = None

    @tool(ends_episode=True)
    def submit(self, answer: str) -> str:
        """Submit the answer; ends the episode.

        Args:
            answer: yes or no
        """
        self.given = answer
        return "ok"

    def check(self, task, transcript):
        if self.given is not None and not self.given.strip():
            return {"correct": self.empty_scores}
        return {"correct": float(self.given == task.private["answer"])}

    def reference(self, task):
        return [ToolInvocation("submit", {"answer": task.private["answer"]})]

    def constant_candidates(self, tasks):  # a free-text answer domain: the best-constant check applies
        return ["maybe"]


class _PaysForNothing(_YesNo):
    empty_scores = 1.0


class _NotAnAnswerDomain(_YesNo):
    constant_candidates = None  # e.g. an ending tool that takes code: no constant-answer check


class _MalformedNoop(_YesNo):
    def noop(self, task):
        return [ToolInvocation("submit", {})]  # the required argument missing: an error message, not an ending


@pytest.fixture
def yes_no():
    made = []

    def register(cls, env_id, **kw):
        registry.register(env_id, lambda **k: ToolEnv(cls(), **k), _yes_no_tasks, **kw)
        made.append(env_id)
        return env_id

    yield register
    for env_id in made:
        registry._REGISTRY.pop(env_id, None)


def _item(report, name):
    return next(i for i in report.items if i.name == name)


def test_do_nothing_really_does_nothing(yes_no):
    # Domain.noop's default calls `submit` without its argument: a malformed call, then a truncated
    # episode that scores 0 whatever the grader does. The checker submits an empty answer instead, so a
    # grader that pays for an empty answer is caught.
    import asyncio

    from envs.play import ScriptedPolicy, run_episode

    env_id = yes_no(_PaysForNothing, "toy-paysnothing-v0")
    env, task = envs.make(env_id), _yes_no_tasks("train", 0, 1)[0]
    try:  # the control: the default noop scores 0 on this broken grader, without reaching it
        tr = asyncio.run(run_episode(env, task, ScriptedPolicy(env.noop(task))))
    finally:
        env.close()
    assert tr.grade.reward == 0.0 and tr.truncated and tr.grade.metrics["malformed_calls"] >= 1
    r = check_env(env_id, n_tasks=2, n_generate=8)
    item = _item(r, "do-nothing scores 0")
    assert not item.passed and "do-nothing scored 1" in item.detail, item
    assert _item(check_env(yes_no(_YesNo, "toy-yesno-v0", default_mix=False, note="prior 0.75"), n_tasks=2,
                           n_generate=8), "do-nothing scores 0").passed
    # A domain's own noop that makes a malformed call is refused by name.
    item = _item(check_env(yes_no(_MalformedNoop, "toy-malformednoop-v0"), n_tasks=2, n_generate=8), "do-nothing scores 0")
    assert not item.passed and "malformed call" in item.detail, item


def test_best_constant_is_reported_and_fails_unless_the_domain_is_marked(yes_no):
    r = check_env(yes_no(_YesNo, "toy-yesnoplain-v0"), n_tasks=2, n_generate=8)
    item = _item(r, "best constant")
    assert not item.passed and "'yes' scores 0.750 on 8 held-out tasks" in item.detail, item
    assert 0.75 >= CONSTANT_LIMIT
    marked = check_env(yes_no(_YesNo, "toy-yesnomarked-v0", default_mix=False, note="constant-answer prior 0.75"),
                       n_tasks=2, n_generate=8)
    item = _item(marked, "best constant")
    assert item.passed and "marked, out of the default mix: constant-answer prior 0.75" in item.detail, item
    assert marked.passed, marked.render()
    item = _item(check_env(yes_no(_NotAnAnswerDomain, "toy-notanswer-v0"), n_tasks=1, n_generate=8), "best constant")
    assert item.passed and "not applicable" in item.detail, item


def test_a_domain_out_of_the_default_mix_must_say_why():
    with pytest.raises(ValueError, match="needs a note"):
        registry.register("toy-nonote-v0", _factory, _tasks, default_mix=False)
    assert "toy-nonote-v0" not in registry._REGISTRY
