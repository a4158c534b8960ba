"""terminal-basics-v0 on the real bubblewrap backend: every family's reference scores 1 on train and
held-out tasks, doing nothing scores 0, near-miss answers score 0, held-out parameter values never
appear in train tasks of the same family, and the conformance checker passes."""
from __future__ import annotations

import asyncio

import pytest

import envs
from envs.base import ToolInvocation
from envs.check import check_env
from envs.play import ScriptedPolicy, run_episode
from envs.terminal.basics import BASIC_FAMILIES
from envs.terminal.tasks import BASICS_ENV_ID, make_basics_tasks, make_task, split_variants

NAMES = list(BASIC_FAMILIES)


def task_of(family: str, split: str = "train", seed: int = 0, k: int = 0):
    return make_task(split, seed, NAMES.index(family) + k * len(NAMES), env_id=BASICS_ENV_ID)


def play(backend, task, invocations) -> float:
    env = envs.make(BASICS_ENV_ID, backend=backend)
    try:
        tr = asyncio.run(run_episode(env, task, ScriptedPolicy(invocations), max_steps=10))
    finally:
        env.close()
    assert tr.grade.error is None, tr.render()
    return tr.grade.reward


def bash(cmd: str) -> list[ToolInvocation]:
    return [ToolInvocation("bash", {"command": cmd}), ToolInvocation("submit")]


@pytest.mark.parametrize("split", ["train", "heldout"])
@pytest.mark.parametrize("family", NAMES)
def test_reference_scores_one_and_doing_nothing_zero(backend, family, split):
    for k in range(2):
        task = task_of(family, split, k=k)
        assert task.private["family"] == family and task.split == split
        env = envs.make(BASICS_ENV_ID, backend=backend)
        ref, noop = env.reference(task), env.noop(task)
        env.close()
        assert play(backend, task, ref) == 1.0
        assert play(backend, task, noop) == 0.0


def test_near_miss_answers_score_zero(backend):
    """The check compares the exact content: an off-by-one, the wrong end of the file or unsorted
    lines do not pass; any command that writes the right answer does."""
    t = task_of("line_count")
    n = int(t.private["check"]["expected"][0])
    assert play(backend, t, bash(f"echo {n + 1} > answer.txt")) == 0.0
    assert play(backend, t, bash(f"echo {n} > answer.txt")) == 1.0
    assert play(backend, t, bash("cat * | wc -w > answer.txt")) == 0.0          # words, not lines
    assert play(backend, task_of("first_line"), bash("tail -n 1 * > answer.txt")) == 0.0
    assert play(backend, task_of("sorted_lines"), bash("cat * > answer.txt")) == 0.0
    assert play(backend, task_of("sorted_lines"), bash("sort -r * > answer.txt")) == 0.0
    t = task_of("distinct_lines")
    assert int(t.private["check"]["expected"][0]) < len(t.public["files"][0]["text"].splitlines())  # repeats exist
    assert play(backend, t, bash("cat * | wc -l > answer.txt")) == 0.0
    assert play(backend, task_of("word_count"), bash("echo > answer.txt")) == 0.0


def test_heldout_parameters_are_unseen_in_train():
    for fam in BASIC_FAMILIES.values():
        sv = split_variants(fam)
        assert sv["heldout"] and sv["train"] and not set(sv["heldout"]) & set(sv["train"])
    train = make_basics_tasks("train", 0)
    held = make_basics_tasks("heldout", 0)
    assert len(train) == 600 and len(held) == 120
    seen = {(t.private["family"], t.private["variant"]) for t in train}
    assert all((t.private["family"], t.private["variant"]) not in seen for t in held)
    # every held-out variant of every family is exercised by the default held-out set
    for name, fam in BASIC_FAMILIES.items():
        used = {t.private["variant"] for t in held if t.private["family"] == name}
        assert len(used) >= 10, (name, len(used))


def test_registered_and_conformant(backend):
    assert BASICS_ENV_ID in [s.env_id for s in envs.list_envs()]
    report = check_env(BASICS_ENV_ID, n_tasks=8, env_kwargs={"backend": backend})
    assert report.passed, report.render()
