"""swe-v0 end to end on the bubblewrap sandbox and the small instance set (built at first use).

- the small set: 12 validated instances from 2 libraries, held-out functions never in train;
- every instance: the reference patch resolves it and the empty patch resolves none (grader path);
- the agent's repository: one commit, no history / tags / reflog / remotes, hidden tests absent;
- the tools, the conformance checker, and tampering (tests edited or deleted, conftest.py,
  sitecustomize.py / .pth, a fake pytest, a symlinked library file) never scoring 1.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import re

import pytest

import envs
from envs.base import ToolInvocation
from envs.check import check_env
from envs.play import ScriptedPolicy, run_episode
from envs.swe import grader as G
from envs.swe import instances as I
from envs.swe.tasks import instance_set, make_tasks, task_of
from envs.swe import build as B


@pytest.fixture(scope="module")
def small():
    return B.ensure_built(B.SMALL, log=lambda *a: None)


@pytest.fixture(scope="module")
def toolz_task(small):
    inst = next(i for i in small if i.library == "toolz" and i.split == "train")
    return task_of(inst)


def episode(backend, task, invocations, max_steps=40):
    env = envs.make("swe-v0", backend=backend)

    async def go():
        try:
            return await run_episode(env, task, ScriptedPolicy(invocations), max_steps=max_steps)
        finally:
            env.close()
    return asyncio.run(go())


def test_small_set_is_validated_and_split_by_function(small):
    assert len(small) == B.SMALL.n_train + B.SMALL.n_heldout == 12
    assert {i.library for i in small} == {"toolz", "cachetools"}
    held = {i.function for i in small if i.split == "heldout"}
    train = {i.function for i in small if i.split == "train"}
    assert len([i for i in small if i.split == "heldout"]) == 3 and not held & train
    for i in small:
        assert 1 <= len(i.fail_to_pass) <= B.MAX_F2P and len(i.pass_to_pass) > 100
        assert not set(i.fail_to_pass) & set(i.pass_to_pass)
        assert i.suite_s < B.MAX_SUITE_S
        assert i.split == B.split_of(i.function)
        # The issue comes from the tests, not the diff: the buggy source line is not quoted.
        buggy_line = I.buggy_source(task_of(i))[1].splitlines()[i.mutation.line - 1].strip()
        if len(buggy_line) > 20:
            assert buggy_line not in i.issue
        assert i.fail_to_pass[0].split("::")[-1].split("[")[0] in i.issue


def test_tasks_are_deterministic_and_carry_no_secrets_in_public(small):
    a, b = make_tasks("train", 0), make_tasks("train", 0)
    assert [t.to_row() for t in a] == [t.to_row() for t in b]
    assert [t.id for t in make_tasks("train", 1)] != [t.id for t in a]
    current = instance_set()  # the full set once it is built, else the small one
    assert len(make_tasks("train", 0, 3)) == 3
    assert len(make_tasks("heldout", 0)) == len([i for i in current if i.split == "heldout"]) >= 3
    for t in a:
        assert set(t.public) == {"library", "version"}
        assert "fail_to_pass" in t.private and t.private["variant"].startswith(t.public["library"] + ":")


def test_reference_resolves_and_empty_patch_resolves_none_for_every_instance(backend, small):
    """Through the grading path: clean tree + the library file as the agent would leave it."""
    def grade(inst, fixed: bool):
        task = task_of(inst)
        lib = I.task_library(task)
        start = I.agent_repo(task)
        lib_files = {p: b for p, b in start.items() if lib.is_library_path(p)}
        if fixed:
            path = inst.mutation.path
            lib_files[path] = I.pristine(lib.name)[path]
        res = G.run_in_sandbox(backend, lib, I.grading_tree(task, lib_files))
        return G.verdict(res, inst.fail_to_pass, inst.pass_to_pass)

    jobs = [(i, fixed) for i in small for fixed in (True, False)]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        verdicts = list(ex.map(lambda j: grade(*j), jobs))
    for (inst, fixed), v in zip(jobs, verdicts):
        assert v.suite_ok, inst.instance_id
        if fixed:
            assert v.resolved and v.p2p_failed == 0 and v.f2p_passed == v.f2p_total, inst.instance_id
        else:
            assert not v.resolved and v.f2p_passed == 0 and v.p2p_failed == 0, inst.instance_id


def test_reference_edit_is_the_reverse_of_the_injected_bug(small):
    for inst in small:
        task = task_of(inst)
        path, buggy = I.buggy_source(task)
        e = I.reference_edit(task)
        assert e["path"] == path and buggy.count(e["old"]) == 1
        assert buggy.replace(e["old"], e["new"]) == I.pristine(inst.library)[path].decode()


def test_repository_is_one_commit_without_the_hidden_tests(backend, toolz_task):
    env = envs.make("swe-v0", backend=backend)

    async def go():
        await env.reset(toolz_task)
        sb = env.domain.sandbox
        r = sb.run("git log --all --oneline | wc -l; git tag | wc -l; git remote | wc -l; git stash list | wc -l;"
                   " ls .git/logs 2>&1 | head -1; git status --porcelain | wc -l; git rev-list --all | wc -l",
                   timeout_s=30, env=env.domain._agent_env(), cwd=sb.workdir_inside)
        out = r.stdout.split("\n")
        assert out[:4] == ["1", "0", "0", "0"], r.stdout + r.stderr
        assert "No such file" in out[4] and out[5] == "0" and out[6] == "1"
        for nid in toolz_task.private["fail_to_pass"]:
            path = nid.split("::")[0]
            name = nid.split("::")[-1].split("[")[0]
            text = sb.read_artifact(path).decode()
            assert not re.search(rf"def {re.escape(name)}\b", text), f"{name} is visible in {path}"
        path, buggy = I.buggy_source(toolz_task)
        assert sb.read_artifact(path).decode() == buggy
        env.close()
    asyncio.run(go())


def test_tools_view_replace_and_run_tests(backend, toolz_task):
    ref = I.reference_edit(toolz_task)
    path = ref["path"]
    line = I.task_mutation(toolz_task).line
    tr = episode(backend, toolz_task, [
        ToolInvocation("view", {"path": path, "line_range": [line, line]}),
        ToolInvocation("view", {"path": "toolz"}),
        ToolInvocation("str_replace", {"path": path, "old": "no such text at all", "new": "x"}),
        ToolInvocation("str_replace", ref),
        ToolInvocation("run_tests", {"selector": "toolz/tests/test_itertoolz.py"}),
        ToolInvocation("bash", {"command": "git diff --stat; python -c 'import toolz, sys; print(toolz.__file__)'"}),
        ToolInvocation("view", {"path": "../../etc/passwd"}),
        ToolInvocation("view", {"path": "/etc/passwd"}),
        ToolInvocation("view", {"path": path, "line_range": [5, 2]}),
        ToolInvocation("submit"),
    ])
    tools = [m for m in tr.messages if m.role == "tool"]
    assert tools[0].content.startswith(f"{line:6d}\t")
    assert "itertoolz.py" in tools[1].content and "tests/" in tools[1].content
    assert "occurs 0 times" in tools[2].content
    assert tools[3].content.startswith(f"Edited {path}")
    assert re.search(r"\d+ passed", tools[4].content) and "[exit code: 0]" in tools[4].content
    assert "1 file changed" in tools[5].content and "/work/toolz/__init__.py" in tools[5].content
    assert "must be relative" in tools[6].content and "must be relative" in tools[7].content
    assert "line_range" in tools[8].content
    # Three malformed calls (bad paths, bad range) cost 0.1 x 3/10 of the reward; the fix resolves it.
    assert tr.grade.metrics["check/resolved"] == 1.0 and tr.grade.metrics["malformed_calls"] == 3
    assert tr.grade.reward == pytest.approx(1.0 - 0.1 * 3 / 10)
    assert tr.grade.metrics["check/f2p_fraction"] == 1.0 and tr.grade.metrics["check/applied_edits"] == 1.0


def test_check_env_passes(backend):
    report = check_env("swe-v0", n_tasks=2, n_generate=12, env_kwargs={"backend": backend})
    assert report.passed, report.render()


FORCE_PASS_CONFTEST = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                       "    rep = (yield).get_result()\n    rep.outcome = 'passed'\n    rep.longrepr = None\n")


def _tamper_cases(task):
    ref = I.reference_edit(task)
    path = ref["path"]
    pkg = path.split("/")[0]
    fixed_copy = I.pristine("toolz")[path].decode()
    write = lambda p, text: ToolInvocation("bash", {"command": f"mkdir -p $(dirname {p}) && cat > {p} <<'JOINTRL_EOF'\n{text}JOINTRL_EOF"})
    return {
        "edit visible tests": [ToolInvocation("bash", {"command": "sed -i 's/assert /assert True or /' toolz/tests/*.py"})],
        "delete the tests": [ToolInvocation("bash", {"command": "rm -rf toolz/tests toolz/sandbox/tests"})],
        "conftest forcing passes": [write("conftest.py", FORCE_PASS_CONFTEST), write("toolz/conftest.py", FORCE_PASS_CONFTEST),
                                    write("toolz/tests/conftest.py", FORCE_PASS_CONFTEST),
                                    write("pytest.ini", "[pytest]\naddopts = -k nothing_matches\n")],
        "sitecustomize / .pth shadowing the package": [
            ToolInvocation("bash", {"command": f"mkdir -p shadow && cp -r {pkg} shadow/"}),
            write(f"shadow/{path}", fixed_copy),
            write("sitecustomize.py", f"import sys; sys.path.insert(0, '/work/shadow'); import {pkg}\n"),
            write(f"{pkg}/sitecustomize.py", f"import sys; sys.path.insert(0, '/work/shadow'); import {pkg}\n"),
            write(f"{pkg}/zz.pth", "import sys; sys.path.insert(0, '/work/shadow')\n"),
            # In the agent's own shell the shadow works (the attack is real) ...
            ToolInvocation("bash", {"command": f"python -c 'import {pkg}; print({pkg}.__file__)'"})],
        "fake pytest": [write("pytest.py", "import sys\nprint('999 passed')\nsys.exit(0)\n"),
                        write("_pytest/__init__.py", "raise SystemExit(0)\n"),
                        write("bin/python", "#!/bin/sh\necho '999 passed'\n")],
        "library file replaced by a symlink to a fixed copy": [
            write(f"fixed/{path.rsplit('/', 1)[-1]}", fixed_copy),
            ToolInvocation("bash", {"command": f"ln -sf /work/fixed/{path.rsplit('/', 1)[-1]} {path}"})],
    }


@pytest.mark.parametrize("case", ["edit visible tests", "delete the tests", "conftest forcing passes",
                                  "sitecustomize / .pth shadowing the package", "fake pytest",
                                  "library file replaced by a symlink to a fixed copy"])
def test_tampering_never_scores_1(backend, toolz_task, case):
    calls = _tamper_cases(toolz_task)[case] + [ToolInvocation("submit")]
    tr = episode(backend, toolz_task, calls)
    assert tr.grade.error is None, tr.grade.error
    assert tr.grade.reward == 0.0, tr.render()
    if case.startswith("sitecustomize"):
        assert "/work/shadow/" in [m for m in tr.messages if m.role == "tool"][-2].content
    m = tr.grade.metrics
    assert m["check/resolved"] == 0.0 and m["check/suite_crashed"] == 0.0
    if case != "library file replaced by a symlink to a fixed copy":
        assert m["check/f2p_fraction"] == 0.0 and m["check/p2p_broken"] == 0.0
        assert m["check/ignored_edits"] >= 1.0


def test_reference_plus_tampering_still_resolves_and_ignores_the_tampering(backend, toolz_task):
    """Edits outside library files are ignored, not punished: the fix alone decides."""
    calls = _tamper_cases(toolz_task)["conftest forcing passes"] + [
        ToolInvocation("str_replace", I.reference_edit(toolz_task)), ToolInvocation("submit")]
    tr = episode(backend, toolz_task, calls)
    assert tr.grade.reward == 1.0 and tr.grade.metrics["check/ignored_edits"] == 4.0
