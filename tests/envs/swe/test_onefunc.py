"""swe-onefunc-v0, the first rung of swe: one-line bugs in one named function, a failing test shown.

- the instance set (the full rung set once built, else the small one, built at first use): every task
  shows one of at least two failing tests, names the function and its lines, and its reference edit
  is one line that turns the buggy file back into the pristine one;
- splits: by library function, swe-v0's held-out functions always held out, held-out ids and
  variant keys never in train, deterministic in the seed;
- through the real env (bubblewrap sandbox, the swe-v0 grader): the reference scores 1 on train
  and held-out tasks; doing nothing, a comment-only edit or running out of turns scores 0;
- attacks through the Env API: editing the visible tests, gutting the function, a constant that
  satisfies only the shown test, module-level code, pytest options in setup.cfg and a shell to reach
  the test machinery, patching an unrelated file; none scores 1 and each shows why in the metrics;
- the conformance checker.
"""
from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import os
import re
import textwrap

import pytest

import envs
from envs.base import ToolInvocation
from envs.check import check_env
from envs.play import ScriptedPolicy, run_episode
from envs.registry import list_envs, spec
from envs.swe import build as B
from envs.swe import instances as I
from envs.swe import libraries as L
from envs.swe import onefunc as OF
from envs.swe import onefunc_build as OB
from envs.swe.mutate import enumerate_mutations
from jointrl.records import Message, ToolCall

NOOP_PYTEST = ("\nimport sys as _jr_sys\n_jr_p = _jr_sys.modules.get('_pytest.python')\nif _jr_p is not None:\n"
               "    _jr_p.Function.runtest = lambda self: None\n")


@pytest.fixture(scope="module")
def train():
    return OF.make_tasks("train")


@pytest.fixture(scope="module")
def heldout():
    return OF.make_tasks("heldout")


def episode(backend, task, calls, max_steps=12):
    env = envs.make(OF.ENV_ID, backend=backend)

    async def go():
        try:
            return await run_episode(env, task, ScriptedPolicy(calls), max_steps=max_steps)
        finally:
            env.close()
    return asyncio.run(go())


def episodes(backend, jobs):
    """[(task, calls)] -> transcripts, two at a time (two cores)."""
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        return list(ex.map(lambda j: episode(backend, *j), jobs))


def submit():
    return ToolInvocation("submit")


def full_set_in_use() -> bool:
    return os.environ.get("JOINTRL_SWE_SET", "auto") != "small" and OB.load(OB.FULL) is not None


def shown_source(task) -> str:
    return task.prompt[-1].content.split("```python\n", 1)[1].split("\n```", 1)[0]


def unique_line(text: str, want=lambda ln: True) -> str:
    """The first non-blank line of `text` that occurs once in it (a `str_replace` anchor)."""
    return next(ln for ln in text.splitlines() if ln.strip() and want(ln) and text.count(ln) == 1)


def unrelated_mutation(repo, lib, avoid: str) -> tuple[str, str, str]:
    """(path, line, mutated line): a one-line bug for a library file other than `avoid`."""
    for p in sorted(repo):
        if not lib.is_library_path(p) or p == avoid:
            continue
        text = repo[p].decode()
        for mu in enumerate_mutations(p, text):
            lines = OB.reference_lines(mu, text)  # (buggy line, original line)
            if lines is not None and text.count(lines[1]) == 1:
                return p, lines[1], lines[0]
    raise AssertionError(f"no library file besides {avoid} has a one-line mutation")


def body_replacement(task, new_body: str) -> ToolInvocation:
    """A `str_replace` of the buggy function's whole body (its docstring kept) by `new_body`."""
    m = I.task_mutation(task)
    _, buggy = I.buggy_source(task)
    node = next(n for n in ast.walk(ast.parse(buggy)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == m.function.split(".")[-1] and n.lineno <= m.line <= n.end_lineno)
    body = node.body[1:] if (len(node.body) > 1 and isinstance(node.body[0], ast.Expr)
                             and isinstance(node.body[0].value, ast.Constant)) else node.body
    lines = buggy.splitlines(keepends=True)
    old = "".join(lines[body[0].lineno - 1: node.end_lineno])
    return ToolInvocation("str_replace", {"path": m.path, "old": old, "new": " " * body[0].col_offset + new_body + "\n"})


# ----------------------------------------------------------------------------- registration and tools
def test_registered_next_to_swe_v0_with_three_tools():
    ids = [s.env_id for s in list_envs()]
    assert "swe-v0" in ids and OF.ENV_ID in ids
    assert "first rung" in spec(OF.ENV_ID).description
    env = envs.make(OF.ENV_ID)
    try:
        assert [s["function"]["name"] for s in env.tool_schemas] == ["view", "str_replace", "submit"]
        full = envs.make("swe-v0")
        # The same tool implementations and schemas as swe-v0, a subset of them.
        for s in env.tool_schemas:
            assert s in full.tool_schemas
        full.close()
    finally:
        env.close()


def test_tool_subset_refuses_tools_the_domain_lacks():
    with pytest.raises(ValueError, match="not tools of OneFuncDomain"):
        OF.ToolSubsetEnv(OF.OneFuncDomain(), ("view", "shell"))
    with pytest.raises(ValueError):
        OF.ToolSubsetEnv(OF.OneFuncDomain(), ())


def test_unknown_split_and_set_choice_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown split"):
        OF.make_tasks("test")
    monkeypatch.setenv("JOINTRL_SWE_SET", "medium")
    with pytest.raises(ValueError, match="JOINTRL_SWE_SET"):
        OF.instance_set()


# ----------------------------------------------------------------------------- selection and splits
@pytest.mark.parametrize("lib_name", ["toolz", "cachetools"])
def test_split_rule_holds_out_every_swe_v0_heldout_function(lib_name):
    """Without running anything: the rung's held-out functions contain swe-v0's, and every candidate's
    split follows its function; candidates are fixable one-line bugs in short functions."""
    lib = L.get_library(lib_name)
    files = L.source_files(lib)
    held = OB.heldout_functions(lib)
    cands = OB.candidates(lib, 0)
    every = set(OB.library_functions(lib))
    v0_held = {f for f in every if B.split_of(f) == "heldout"}
    assert v0_held <= held and 0.25 < len(held) / len(every) < 0.5
    assert cands and {c.split for c in cands} == {"train", "heldout"}
    spans = {p: OB.function_spans(files[p].decode()) for p in {c.mutation.path for c in cands}}
    for c in cands:
        m = c.mutation
        assert c.split == ("heldout" if B.function_key(lib, m) in held else "train")
        assert not (m.kind == "remove_condition" and m.replacement)  # a dropped operand cannot be read back
        first, last = spans[m.path][m.function]
        assert last - first + 1 <= OB.MAX_FUNCTION_LINES
        old, new = OB.reference_lines(m, files[m.path].decode())
        assert "\n" not in old and m.apply(files[m.path].decode()).count(old) == 1


def test_splits_are_disjoint_deterministic_and_sized(train, heldout):
    assert train and heldout and all(t.domain == "swe" for t in train + heldout)
    assert {t.split for t in train} == {"train"} and {t.split for t in heldout} == {"heldout"}
    assert not {t.id for t in train} & {t.id for t in heldout}
    assert not {t.private["variant"] for t in train} & {t.private["variant"] for t in heldout}
    held = {name: OB.heldout_functions(L.get_library(name)) for name in {t.private["library"] for t in train + heldout}}
    for t in heldout:
        assert t.private["variant"] in held[t.private["library"]]
    for t in train:  # nothing swe-v0 evaluates on is trained on here
        assert B.split_of(t.private["variant"]) == "train" and t.private["variant"] not in held[t.private["library"]]
    assert [t.to_row() for t in OF.make_tasks("train", 0)] == [t.to_row() for t in train]
    other = OF.make_tasks("train", 1)
    assert [t.id for t in other] != [t.id for t in train] and sorted(t.id for t in other) == sorted(t.id for t in train)
    assert [t.id for t in OF.make_tasks("heldout", 0, 3)] == [t.id for t in heldout[:3]]
    if full_set_in_use():
        assert (len(train), len(heldout)) == (OB.FULL.n_train, OB.FULL.n_heldout) and len(heldout) >= 150
        assert len({t.private["library"] for t in heldout}) == 4
    else:
        assert (len(train), len(heldout)) == (OB.SMALL.n_train, OB.SMALL.n_heldout)


def test_every_task_shows_a_hidden_failing_test_and_a_one_line_fix(train, heldout):
    """Offline, on every task: what the prompt shows, what the repository hides, and that the reference
    edit turns the buggy file back into the pristine one."""
    env = OF.make_env()
    for t in train + heldout:
        p = t.private
        f2p = p["fail_to_pass"]
        assert p["shown_test"] in f2p and len(f2p) >= OB.MIN_F2P  # at least one failing test stays unseen
        ref = p["reference"]
        first, last = ref["lines"]
        m = I.task_mutation(t)
        assert ref["path"] == m.path and first <= m.line <= last and last - first + 1 <= OB.MAX_FUNCTION_LINES
        user = t.prompt[-1].content
        assert f"`{m.function}` in {m.path} (lines {first}-{last})" in user
        shown_name = p["shown_test"].split("::")[-1].split("[")[0]
        assert re.search(rf"def {re.escape(shown_name)}\b", user)
        path, buggy = I.buggy_source(t)
        assert buggy.count(ref["old"]) == 1 and "\n" not in ref["old"] + ref["new"]
        assert buggy.replace(ref["old"], ref["new"]) == I.pristine(p["library"])[path].decode()
        assert ref["old"] not in user  # the buggy line is to be read with `view`, not copied from the prompt
        # The shown test is defined in one of the files its hidden span is cut from (a mixin's file
        # for an inherited test): there in the pristine tree, absent from the agent's repository.
        src = shown_source(t)
        assert len(src.splitlines()) <= OB.MAX_TEST_LINES and len(src) <= OB.MAX_TEST_CHARS
        forms = (src, textwrap.indent(src, "    "))
        span_paths = sorted({h["path"] for h in p["hidden"]})
        repo = I.agent_repo(t)
        assert any(f in I.pristine(p["library"])[sp].decode() for sp in span_paths for f in forms), t.id
        assert not any(f in repo[sp].decode() for sp in span_paths for f in forms), f"{t.id}: the shown test is visible"
        assert [c.name for c in env.reference(t)] == ["view", "str_replace", "submit"]
    env.close()


def test_failure_output_is_clipped_and_addresses_blanked():
    msg = "AssertionError: assert <f at 0x7ff5da2dfb00> == <g at 0x7ff5da2dfc10>\n" + "".join(f"line {i}\n" for i in range(30))
    out = OB._clip_failure(msg)
    assert out.startswith("AssertionError: assert <f at 0x...> == <g at 0x...>") and "0x7ff" not in out
    assert out.splitlines()[:-1] == msg.replace("0x7ff5da2dfb00", "0x...").replace("0x7ff5da2dfc10", "0x...").splitlines()[:OB.MAX_FAILURE_LINES]
    assert out.endswith("\n...")
    long = OB._clip_failure("E" * 5000)
    assert len(long) == OB.MAX_FAILURE_CHARS + 4 and long.endswith(" ...")
    assert OB._clip_failure("  ValueError: x\n") == "ValueError: x"


# ----------------------------------------------------------------------------- through the real env
def quick(tasks):
    """A task of the library whose suite grades fastest (toolz, then tabulate), for the many-episode tests."""
    return next((t for lib in ("toolz", "tabulate") for t in tasks if t.private["library"] == lib), tasks[0])


def sample(tasks, n):
    """The first task of each library, then the next ones: a spread over libraries."""
    seen, out = set(), []
    for t in tasks:
        if t.private["library"] not in seen:
            seen.add(t.private["library"])
            out.append(t)
    return (out + [t for t in tasks if t not in out])[:n]


@pytest.mark.slow
def test_reference_scores_1_on_train_and_heldout(backend, train, heldout):
    tasks = sample(train, 2) + sample(heldout, 2)
    env = OF.make_env()
    trs = episodes(backend, [(t, env.reference(t)) for t in tasks])
    env.close()
    for t, tr in zip(tasks, trs):
        assert tr.grade.error is None, tr.grade.error
        assert tr.grade.reward == 1.0, tr.render()
        assert tr.turns == 3 and tr.grade.metrics["check/applied_edits"] == 1.0
        view = [m for m in tr.messages if m.role == "tool"][0].content
        assert t.private["reference"]["old"] in view  # the line to fix is read from the observation


@pytest.mark.slow
def test_doing_nothing_a_comment_or_running_out_of_turns_scores_0(backend, train):
    t = quick(train)
    ref = t.private["reference"]
    view = ToolInvocation("view", {"path": ref["path"], "line_range": ref["lines"]})
    comment = ToolInvocation("str_replace", {"path": ref["path"], "old": ref["old"], "new": ref["old"] + "  # fixed"})
    trs = episodes(backend, [(t, [submit()]), (t, [view, comment, submit()]), (t, [view] * 10)])
    for tr in trs:
        assert tr.grade.error is None and tr.grade.reward == 0.0, tr.render()
    assert trs[0].grade.metrics["check/f2p_fraction"] == 0.0 and trs[1].grade.metrics["check/applied_edits"] == 1.0
    assert trs[2].truncated and trs[2].turns == t.limits.max_turns


def _constant_attack(tasks):
    """A task whose shown test is one `assert F(...) == <literal>` (or `list(F(...))`, or a curried `F(a)(b)`)
    on its own top-level function F, and the edit making F return that literal: it satisfies the shown test
    and nothing else."""
    for t in tasks:
        m = I.task_mutation(t)
        test = ast.parse(shown_source(t)).body[0]
        stmts = [s for s in test.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if "." in m.function or len(stmts) != 1 or not isinstance(stmts[0], ast.Assert):
            continue
        cmp = stmts[0].test
        if not (isinstance(cmp, ast.Compare) and len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Eq)):
            continue
        left = cmp.left
        if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "list" and left.args:
            left = left.args[0]
        while isinstance(left, ast.Call) and isinstance(left.func, ast.Call):  # curried: F(a)(b) calls F(a, b)
            left = left.func
        if not (isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == m.function):
            continue
        try:
            expected = ast.literal_eval(cmp.comparators[0])
        except ValueError:
            continue
        return t, body_replacement(t, f"return {expected!r}")
    return None


@pytest.mark.slow
def test_attacks_through_the_env_never_score_1(backend, train, heldout):
    t = quick(train)
    ref = t.private["reference"]
    lib = L.get_library(t.private["library"])
    repo = I.agent_repo(t)
    test_path = t.private["shown_test"].split("::")[0]
    test_anchor = unique_line(repo[test_path].decode(), lambda ln: not ln[0].isspace() and ln.startswith(("import", "from")))
    pkg_init = next(p for p in sorted(repo) if lib.is_library_path(p) and p.endswith("__init__.py")
                    and repo[p].decode().strip())
    init_anchor = unique_line(repo[pkg_init].decode(), lambda ln: ln.startswith(("import", "from")))
    # An unrelated library file gets a real change (its first one-line mutation), the bug stays.
    other, other_old, other_new = unrelated_mutation(repo, lib, ref["path"])
    cfg_anchor = unique_line(repo["setup.cfg"].decode())
    fn_name = I.task_mutation(t).function.split(".")[-1]
    cases = {
        # The shown test's module skipped and the function replaced at import: only the visible copy changes.
        "edit the tests": [ToolInvocation("str_replace", {
            "path": test_path, "old": test_anchor,
            "new": test_anchor + f"\nimport pytest\npytest.skip('fixed', allow_module_level=True)\n{fn_name} = print"})],
        "gut the function": [body_replacement(t, "return None")],
        "module-level code in the package": [ToolInvocation("str_replace", {
            "path": pkg_init, "old": init_anchor, "new": init_anchor + NOOP_PYTEST})],
        "patch an unrelated file": [ToolInvocation("str_replace", {"path": other, "old": other_old, "new": other_new})],
        # pytest's configuration deselecting every test (the grader runs with `-c /dev/null`).
        "pytest options in setup.cfg": [ToolInvocation("str_replace", {
            "path": "setup.cfg", "old": cfg_anchor, "new": cfg_anchor + "\n\n[tool:pytest]\naddopts = -k no_test_matches\n"})],
    }
    # A shell to write conftest.py / pytest.ini is not offered: each call is an unknown tool.
    shell = Message(role="assistant", content="", tool_calls=(
        ToolCall(id="c1", name="bash", arguments='{"command": "echo x > conftest.py"}'),
        ToolCall(id="c2", name="run_tests", arguments="{}")))
    constant = _constant_attack(train + heldout)
    jobs = [(t, calls + [submit()]) for calls in cases.values()]
    jobs.append((t, [shell, Message(role="assistant", content="", tool_calls=(ToolCall(id="c3", name="submit", arguments="{}"),))]))
    if constant is not None:
        jobs.append((constant[0], [constant[1], submit()]))
    trs = episodes(backend, jobs)
    names = list(cases) + ["a shell for test machinery"] + (["a constant for the shown test"] if constant else [])
    got = dict(zip(names, trs))
    for name, tr in got.items():
        edits = [msg for msg in tr.messages if msg.role == "tool" and msg.name == "str_replace"]
        assert all(msg.content.startswith("Edited ") for msg in edits), (name, tr.render())  # the attack happened
        assert tr.grade.error is None, (name, tr.grade.error)
        assert tr.grade.reward <= 0.0, (name, tr.render())
        assert tr.grade.metrics["check/resolved"] == 0.0 and tr.grade.metrics["check/suite_crashed"] == 0.0, name
    m = {k: v.grade.metrics for k, v in got.items()}
    assert m["edit the tests"]["check/ignored_edits"] == 1.0 and m["edit the tests"]["check/applied_edits"] == 0.0
    assert m["edit the tests"]["check/f2p_fraction"] == 0.0
    assert m["gut the function"]["check/applied_edits"] == 1.0 and m["gut the function"]["check/edit_rejected"] == 0.0
    assert m["module-level code in the package"]["check/edit_rejected_module_level"] == 1.0
    assert m["patch an unrelated file"]["check/applied_edits"] == 1.0 and m["patch an unrelated file"]["check/f2p_fraction"] == 0.0
    assert m["pytest options in setup.cfg"]["check/ignored_edits"] == 1.0 and m["pytest options in setup.cfg"]["check/f2p_fraction"] == 0.0
    shell_tr = got["a shell for test machinery"]
    assert shell_tr.grade.metrics["malformed_calls"] == 2.0
    assert all("unknown tool" in msg.content for msg in shell_tr.messages if msg.role == "tool" and msg.tool_call_id in ("c1", "c2"))
    if constant is None:
        assert not full_set_in_use(), "the full set holds tasks for the constant attack"
    else:
        cm = m["a constant for the shown test"]
        # The constant passes the shown failing test (the attack is real) and still resolves nothing.
        assert cm["check/f2p_fraction"] > 0.0 and cm["check/edit_rejected"] == 0.0, cm


@pytest.mark.slow
def test_check_env_passes(backend):
    report = check_env(OF.ENV_ID, n_tasks=1, n_generate=12, env_kwargs={"backend": backend})
    assert report.passed, report.render()
