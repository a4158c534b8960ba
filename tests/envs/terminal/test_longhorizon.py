"""terminal-longhorizon-v0 (envs/terminal/longhorizon.py): the reference solves every task with >= 20 tool calls,
the whole history outgrows a 1024-token context several times, held-out variants are disjoint from train's, and
nothing a policy writes reaches a log it was not told the name of."""
from __future__ import annotations

import asyncio

import pytest

import envs
from envs.base import ToolInvocation
from envs.check import check_env
from envs.play import ScriptedPolicy, run_episode
from envs.terminal.longhorizon import ENV_ID, split_variants
from jointrl.records import Task
from rl.rollout.codec import make_codec


def _tasks(split: str, n: int) -> list[Task]:
    return [Task.from_row(r) for r in envs.tasks(ENV_ID, split, seed=0, n=n)]


def _play(task: Task, calls):
    env = envs.make(ENV_ID)
    try:
        return asyncio.run(run_episode(env, task, ScriptedPolicy(list(calls)), max_steps=60))
    finally:
        env.close()


def test_reference_solves_every_task_with_twenty_calls_and_a_history_past_the_context():
    codec = make_codec("jointrl", None)
    for task in _tasks("train", 24) + _tasks("heldout", 24):
        env = envs.make(ENV_ID)
        ref = env.reference(task)
        tr = _play(task, ref)
        assert tr.grade.reward == 1.0 and tr.terminated, task.id
        assert len(ref) >= 21  # 20+ logs, each read by its own call, then submit
        assert len(codec.prompt_ids(list(tr.messages), env.tool_schemas)) > 4 * 1024


def test_heldout_variants_are_disjoint_and_the_conformance_check_passes():
    v = split_variants()
    assert v["heldout"] and not set(v["heldout"]) & set(v["train"])
    held = {t.private["variant"] for t in _tasks("heldout", 60)}
    train = {t.private["variant"] for t in _tasks("train", 200)}
    assert held and not held & train
    report = check_env(ENV_ID, n_tasks=2, n_generate=16)
    assert report.passed, report.render()


def test_shortcuts_score_zero():
    task = _tasks("train", 1)[0]
    wrong = str(int(task.private["expected"]) + 1)
    assert _play(task, [ToolInvocation("submit", {"answer": wrong})]).grade.reward == 0.0
    # a guessed name reads nothing; reading only the first log and guessing does not pass either
    first = task.private["trail"][0]
    tr = _play(task, [ToolInvocation("read_log", {"name": "log-000000"}), ToolInvocation("read_log", {"name": first}),
                      ToolInvocation("submit", {"answer": "0" if task.private["expected"] != "0" else "1"})])
    assert "no log named" in tr.messages[3].content and tr.grade.reward == 0.0


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_answers_vary_so_a_constant_answer_cannot_pass(split):
    answers = [t.private["expected"] for t in _tasks(split, 40)]
    assert max(answers.count(a) for a in set(answers)) / len(answers) < 0.35


def test_the_xl_variant_gives_episodes_past_16k_tokens_and_passes_the_conformance_check():
    from envs.terminal.longhorizon import XL_ENV_ID

    codec = make_codec("jointrl", None)
    tasks = [Task.from_row(r) for r in envs.tasks(XL_ENV_ID, "train", seed=0, n=3)]
    lengths = []
    for task in tasks:
        env = envs.make(XL_ENV_ID)
        try:
            tr = asyncio.run(run_episode(env, task, ScriptedPolicy(list(env.reference(task))), max_steps=60))
            assert tr.grade.reward == 1.0 and tr.terminated, task.id
            seen = "\n".join(m.content or "" for m in tr.messages if m.role == "tool")
            assert all(task.public["logs"][n] in seen for n in task.private["trail"]), task.id  # no log cut short
            lengths.append(len(codec.prompt_ids(list(tr.messages), env.tool_schemas)))
        finally:
            env.close()
    assert min(lengths) > 16_384, lengths
    # tasks of their own, not the base rung's
    base = _tasks("train", 1)[0]
    assert tasks[0].id != base.id and tasks[0].public["logs"] != base.public["logs"]
    report = check_env(XL_ENV_ID, n_tasks=2, n_generate=16)
    assert report.passed, report.render()
