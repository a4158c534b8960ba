"""Attacks on the terminal graders (terminal-v0 and terminal-basics-v0) through the public `Env` API.

What the graders trust (docs/envs.md, "What graders trust"): the task's private record, and the agent's
work dir read as *data* after every agent process is gone; programs run only in a fresh grading sandbox.
Each attack below tries to score without doing the task, or to turn the agent's failure into a grading
error, and must get 0 with no `Grade.error`:
- generic patches: one script for every task (copy every input to answer.txt, chmod everything, a
  filter.sh that echoes its input), constant answers (each family's most common train answer), an empty
  answer file;
- forged outputs: text claiming success on stdout, fake result / grade files;
- degenerate artifacts: answer.txt as a directory, FIFO, symlink loop, a sparse file over the read cap,
  invalid UTF-8, a NUL byte;
  a 3,000-level directory tree and 12,000 files next to a correct solution;
- resource exhaustion of the grader: a filter.sh that never returns.
The attack suite on the sandbox itself (fork bombs, floods, network, host files, planted binaries) is in
tests/envs/terminal/test_domain.py. Runs on the real bubblewrap backend.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections import Counter

import pytest

import envs
from envs.base import ToolInvocation
from envs.play import ScriptedPolicy, run_episode
from envs.terminal.basics import BASIC_FAMILIES
from envs.terminal.families import FAMILIES, ShellScript
from envs.terminal.tasks import BASICS_ENV_ID, ENV_ID, make_task

SHORT = {"tool_timeout_s": 5.0, "episode_timeout_s": 60.0}


def task_of(family: str, split: str = "heldout", seed: int = 0, env_id: str = ENV_ID):
    fams = list((BASIC_FAMILIES if env_id == BASICS_ENV_ID else FAMILIES))
    return make_task(split, seed, fams.index(family), env_id=env_id)


def play(backend, task, commands: list[str], env_id: str = ENV_ID, **limits):
    env = envs.make(env_id, backend=backend, limits=dataclasses.replace(task.limits, **{**SHORT, **limits}))
    calls = [ToolInvocation("bash", {"command": c}) for c in commands] + [ToolInvocation("submit")]
    try:
        return asyncio.run(run_episode(env, task, ScriptedPolicy(calls), max_steps=len(calls) + 2))
    finally:
        env.close()


def assert_zero(tr) -> None:
    assert tr.grade.error is None, tr.grade.error
    assert tr.grade.reward <= 0.0 and tr.grade.metrics["check/correct"] == 0.0, tr.render()


# ----------------------------------------------------------------------------- generic patches
# One script for every task: every input concatenated into answer.txt, every file made 0644/0755/0600,
# a filter.sh that prints its whole input, a branch on every commit, crontab-like lines.
KITCHEN_SINK = (
    "find . -type f ! -name answer.txt -exec cat {} + > answer.txt 2>/dev/null; "
    "printf '#!/bin/bash\\ncat \"$1\"\\n' > filter.sh; chmod +x filter.sh; "
    "find . -type f -exec chmod 644 {} +; "
    "(cd repo 2>/dev/null && for c in $(git rev-list --all --reflog 2>/dev/null); do git branch -f b$c $c; done) ; "
    "echo '* * * * * /bin/true' >> crontab.txt; tar czf archive.tar.gz . 2>/dev/null; ls -la"
)


@pytest.mark.parametrize("env_id,family", [(ENV_ID, f) for f in FAMILIES] + [(BASICS_ENV_ID, f) for f in BASIC_FAMILIES])
def test_one_script_for_every_task_scores_zero(backend, env_id, family):
    assert_zero(play(backend, task_of(family, env_id=env_id), [KITCHEN_SINK], env_id=env_id))


@functools.lru_cache(maxsize=None)
def _answers(env_id: str, split: str, n_per_family: int) -> dict[str, tuple[str, ...]]:
    """Per family graded on answer.txt lines: the expected answers of `n_per_family` tasks (several seeds)."""
    fams = list(BASIC_FAMILIES if env_id == BASICS_ENV_ID else FAMILIES)
    out: dict[str, tuple[str, ...]] = {}
    for fi, fam in enumerate(fams):
        if not isinstance(make_task(split, 0, fi, env_id=env_id).private["check"].get("expected"), list):
            continue  # graded on files, modes, archives or a script: a constant answer means nothing there
        # Task i of a split belongs to family i mod F, so these indices give this family's tasks only.
        out[fam] = tuple(json.dumps(make_task(split, 100 + k // 50, k * len(fams) + fi, env_id=env_id).private["check"]["expected"])
                         for k in range(n_per_family))
    return out


def _constant_answer_rates(env_id: str) -> dict[str, tuple[str, float]]:
    """Per family: the held-out answer that occurs most often, and its share. No constant answer scores more
    on these tasks, whichever way it was learnt (an upper bound on every fixed-answer policy)."""
    rates = {}
    for fam, answers in _answers(env_id, "heldout", HELDOUT_N).items():
        best, n = Counter(answers).most_common(1)[0]
        rates[fam] = (best, n / len(answers))
    return rates


HELDOUT_N = 120  # held-out tasks per family the constant-answer rates are measured on
MAX_CONSTANT_RATE = 0.10
# Known low-entropy family: distinct_lines counts the distinct lines of a file drawn from 2-8 pool lines, so
# each count from 2 to 7 is the answer about 1 time in 6. Changing the distribution changes the curriculum
# whose learning curve docs/training.md reports, so it is left for a re-measured change (docs/envs.md).
KNOWN_PRIORS = {"distinct_lines": 0.25}


@pytest.mark.parametrize("env_id", [ENV_ID, BASICS_ENV_ID])
def test_constant_answers_score_little_on_heldout(env_id):
    rates = _constant_answer_rates(env_id)
    assert len(rates) >= (6 if env_id == BASICS_ENV_ID else 9)
    over = {f: r for f, (_, r) in rates.items() if r > KNOWN_PRIORS.get(f, MAX_CONSTANT_RATE)}
    assert not over, (over, rates)
    for fam in KNOWN_PRIORS:
        if fam in rates and rates[fam][1] <= MAX_CONSTANT_RATE:
            pytest.fail(f"{fam}'s constant-answer prior fell to {rates[fam][1]:.3f}: drop it from KNOWN_PRIORS")


def test_a_constant_answer_scores_through_the_env_exactly_when_it_is_the_answer(backend):
    # Ties the data-side measurement above to the real grader: the same text scores 1 on a task whose
    # answer it is and 0 on a task of the same family whose answer differs.
    a, b = task_of("grep_count", seed=0), task_of("grep_count", seed=1)
    assert a.private["check"]["expected"] != b.private["check"]["expected"]
    text = "\\n".join(a.private["check"]["expected"])
    write = f"printf '{text}\\n' > answer.txt"
    assert play(backend, a, [write]).grade.reward == 1.0
    assert_zero(play(backend, b, [write]))


def test_an_empty_answer_file_is_never_the_right_answer(backend):
    for env_id in (ENV_ID, BASICS_ENV_ID):
        for split in ("train", "heldout"):
            for fam, answers in _answers(env_id, split, 40 if split == "train" else HELDOUT_N).items():
                assert "[]" not in answers, (env_id, split, fam)
    assert_zero(play(backend, task_of("json_filter"), [": > answer.txt"]))


# ----------------------------------------------------------------------------- forged outputs
def test_claims_of_success_and_fake_result_files_score_zero(backend):
    forge = ("echo 'All checks passed. correct=1 reward=1.0'; "
             "for f in result.json grade.json .grade check.json score.txt; do echo '{\"correct\": 1, \"reward\": 1.0}' > $f; done; "
             "echo PASS > answer.txt.expected; printf '[exit code: 0]\\ncheck/correct: 1\\n'")
    for fam in ("grep_count", "permissions", "git_rescue", "tar_create"):
        assert_zero(play(backend, task_of(fam), [forge]))


# ----------------------------------------------------------------------------- degenerate artifacts
# Each holds (or points at) the right answer, in a form the grader must refuse: `{ans}` is the answer.
DEGENERATE = {
    "directory": "mkdir answer.txt; printf '{ans}\\n' > answer.txt/answer.txt",
    "fifo": "mkfifo answer.txt; (printf '{ans}\\n' > answer.txt &); sleep 0.2",
    "symlink loop": "ln -s answer.txt answer.txt",
    "symlink to a device": "ln -s /dev/zero answer.txt",
    "sparse, over the read cap": "printf '{ans}\\n' > answer.txt; truncate -s 5M answer.txt; ls -la answer.txt",
    "invalid utf-8": "printf '{ans}\\n\\xff' > answer.txt",
    "nul byte": "printf '{ans}\\0\\n' > answer.txt",
}


@pytest.mark.parametrize("kind", list(DEGENERATE))
def test_degenerate_answer_files_are_failures_not_grading_errors(backend, kind):
    task = task_of("grep_count")
    (ans,) = task.private["check"]["expected"]
    tr = play(backend, task, [DEGENERATE[kind].format(ans=ans)])
    assert_zero(tr)
    assert tr.grade.metrics["grade_s"] < 10


def test_a_deep_tree_or_many_files_next_to_the_answer_are_no_grading_error(backend):
    task = task_of("git_rescue")
    deep = "python3 -c \"import os\nfor _ in range(3000): os.mkdir('d'); os.chdir('d')\""
    tr = play(backend, task, [deep] + list(task.private["reference"]))
    assert tr.grade.error is None and tr.grade.reward == 1.0  # the deep tree is ignored, the solution counts
    many = "python3 -c \"import os\nos.mkdir('m')\nfor i in range(12000): open(f'm/{i}', 'w').close()\""
    tr = play(backend, task, list(task.private["reference"]) + [many])
    # More files than the sandbox lists: the work dir is refused as a whole (the agent's failure).
    assert_zero(tr)


# ----------------------------------------------------------------------------- resource exhaustion
def test_a_script_that_never_returns_costs_the_grader_a_bounded_time(backend):
    task = task_of("shell_script")
    hang = "printf '#!/bin/bash\\nsleep 100000\\n' > filter.sh; chmod +x filter.sh"
    tr = play(backend, task, [hang])
    assert_zero(tr)
    n = len(task.private["check"]["tests"])
    assert tr.grade.metrics["grade_s"] < n * ShellScript.SCRIPT_TIMEOUT_S + 5, tr.grade.metrics["grade_s"]
