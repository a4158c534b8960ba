"""terminal-v0 on the real bubblewrap backend: every family's reference scores 1 and doing nothing 0,
the conformance checker passes, budgets hold, and the attack suite's scoring part: each attack episode
scores 0, ends within its budget, and leaves no process of its sandbox uid behind."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time

import pytest

import envs
from envs.base import ToolInvocation
from envs.check import check_env
from envs.play import ScriptedPolicy, run_episode
from envs.sandbox.base import SandboxLimits
from envs.terminal.families import FAMILIES
from envs.terminal.tasks import make_task, split_variants

FAMILY_NAMES = list(FAMILIES)


def task_of(family: str, split: str = "train", seed: int = 0):
    return make_task(split, seed, FAMILY_NAMES.index(family))


def play(backend, task, invocations, *, limits=None, sandbox_limits=None):
    """One episode; returns (transcript, sandbox uid, wall seconds)."""
    kw = {"backend": backend}
    if limits is not None:
        kw["limits"] = limits
    if sandbox_limits is not None:
        kw["sandbox_limits"] = sandbox_limits
    env = envs.make("terminal-v0", **kw)
    uid = {}

    async def go():
        orig = env.domain.setup

        def setup(t):
            orig(t)
            uid["uid"] = getattr(env.domain.sandbox, "uid", None)
        env.domain.setup = setup
        return await run_episode(env, task, ScriptedPolicy(invocations), max_steps=50)

    t0 = time.monotonic()
    try:
        tr = asyncio.run(go())
    finally:
        env.close()
    return tr, uid.get("uid"), time.monotonic() - t0


def leftover_pids(uid: int | None) -> list[int]:
    from envs.sandbox.hostctl import pids_of_uid

    return pids_of_uid(uid) if uid is not None else []


# ----------------------------------------------------------------------------- families
@pytest.mark.parametrize("split", ["train", "heldout"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reference_scores_one_and_doing_nothing_scores_zero(backend, family, split):
    task = task_of(family, split)
    env = envs.make("terminal-v0", backend=backend)
    ref, noop = env.reference(task), env.noop(task)
    env.close()
    tr, _, _ = play(backend, task, ref)
    assert tr.grade.error is None and tr.grade.reward == 1.0, tr.render()
    tr, _, _ = play(backend, task, noop)
    assert tr.grade.error is None and tr.grade.reward == 0.0, tr.render()


def test_there_are_at_least_twelve_families_with_disjoint_heldout_variants():
    assert len(FAMILIES) >= 12
    for fam in FAMILIES.values():
        sv = split_variants(fam)
        assert sv["train"] and sv["heldout"] and not set(sv["train"]) & set(sv["heldout"]), fam.name


def test_a_wrong_answer_scores_zero(backend):
    task = task_of("grep_count")
    tr, _, _ = play(backend, task, [ToolInvocation("bash", {"command": "echo 999999 > answer.txt"}), ToolInvocation("submit")])
    assert tr.grade.reward == 0.0 and tr.grade.error is None


def test_conformance_checker_passes_on_the_real_backend(backend):
    report = check_env("terminal-v0", n_tasks=3, n_generate=28, env_kwargs={"backend": backend})
    assert report.passed, report.render()


def test_private_data_never_reaches_the_agent():
    for fam in FAMILY_NAMES:
        task = task_of(fam)
        seen = " ".join(m.content for m in task.prompt) + str(dict(task.public))
        for cmd in task.private["reference"]:
            assert cmd not in seen, fam
        if fam == "shell_script":  # the hidden test inputs
            assert all(t["input"] not in seen for t in task.private["check"]["tests"])


# ----------------------------------------------------------------------------- budgets
SHORT = dict(tool_timeout_s=2.0, episode_timeout_s=30.0)


def limits_for(task, **kw):
    return dataclasses.replace(task.limits, **{**SHORT, **kw})


def test_tool_timeout_kills_sleep_and_the_episode_goes_on(backend):
    task = task_of("grep_count")
    ref = envs.make("terminal-v0", backend=backend).reference(task)
    tr, uid, wall = play(backend, task, [ToolInvocation("bash", {"command": "sleep 100000"})] + ref,
                         limits=limits_for(task))
    killed = tr.messages[len(task.prompt) + 1].content
    assert "killed: the command exceeded its 2.0 s time limit" in killed
    assert tr.grade.reward == 1.0 and tr.grade.metrics["tool_timeouts"] == 1 and wall < 15
    assert leftover_pids(uid) == []


def test_a_flood_is_clipped_to_max_obs_chars(backend):
    task = task_of("grep_count")
    flood = "head -c 100000000 /dev/zero | tr '\\0' a; echo END"
    tr, _, wall = play(backend, task, [ToolInvocation("bash", {"command": flood}), ToolInvocation("submit")],
                       limits=limits_for(task, max_obs_chars=500, tool_timeout_s=20.0))
    obs = tr.messages[len(task.prompt) + 1].content
    assert len(obs) <= 500 and "characters clipped" in obs and obs.rstrip().endswith("]")
    assert tr.grade.reward == 0.0 and wall < 30


# ----------------------------------------------------------------------------- attack suite (scoring part)
ATTACKS = {
    "fork bomb": ":(){ :|:& };:",
    "memory bomb": "python3 -c \"x = bytearray(8 * 1024**3)\"; echo $?",
    "cpu loop": "while :; do :; done",
    "sleep": "sleep 100000",
    "disk fill": "dd if=/dev/zero of=fill bs=1M count=100000; ls -la",
    "stdout flood": "head -c 100000000 /dev/zero | tr '\\0' x",
    "kill everything": "kill -9 -1; echo survived",
    "daemon": "setsid sleep 100000 > /dev/null 2>&1 < /dev/null & disown; echo started",
    "host files": "cat /work/main/README.md /root/.bashrc /etc/shadow > answer.txt; ls / >> answer.txt",
    "write outside": "echo x > /usr/evil; echo x > /etc/evil; echo x > /evil; mkdir -p ../escape",
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_episodes_score_zero_end_in_budget_and_leave_nothing(backend, attack):
    task = task_of("grep_count")
    limits = limits_for(task, tool_timeout_s=3.0)
    tr, uid, wall = play(backend, task, [ToolInvocation("bash", {"command": ATTACKS[attack]}), ToolInvocation("submit")],
                         limits=limits, sandbox_limits=SandboxLimits(workdir_mb=16, tmp_mb=16))
    assert tr.grade.error is None and tr.grade.reward == 0.0, tr.render()
    # one command (3 s) plus set-up, kill and grading; generous for a loaded 2-core machine
    assert wall < 25, wall
    assert leftover_pids(uid) == []
    assert not os.path.exists("/usr/evil") and not os.path.exists("/evil")


def test_network_attack_reaches_no_server_and_scores_zero(backend):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    hits = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                hits.append(1)
                conn.close()
            except OSError:
                pass
    th = threading.Thread(target=accept, daemon=True)
    th.start()
    cmd = (f"getent hosts example.com; python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"; "
           f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected")
    task = task_of("grep_count")
    try:
        tr, _, _ = play(backend, task, [ToolInvocation("bash", {"command": cmd}), ToolInvocation("submit")],
                        limits=limits_for(task))
    finally:
        stop.set()
        th.join(2)
        srv.close()
    assert hits == [] and "connected" not in tr.messages[len(task.prompt) + 1].content.replace("exit code", "")
    assert tr.grade.reward == 0.0


def test_symlink_to_a_host_secret_holding_the_right_answer_scores_zero(backend, tmp_path):
    task = task_of("grep_count")
    secret = tmp_path / "secret_answer.txt"
    secret.write_text(task.private["check"]["expected"][0] + "\n")  # a host reader following links would score 1
    os.chmod(tmp_path, 0o755)
    tr, _, _ = play(backend, task, [ToolInvocation("bash", {"command": f"ln -s {secret} answer.txt; ls -la"}),
                                    ToolInvocation("submit")], limits=limits_for(task))
    assert tr.grade.reward == 0.0 and tr.grade.error is None


def test_replacement_binaries_in_the_work_dir_do_not_fool_the_grader(backend):
    # A fake `git` that would print exactly what the grader checks, and a fake `find` that would
    # report the wanted permission modes: a grader that ran programs from the agent's filesystem or
    # PATH would score these 1.
    task = task_of("git_rescue")
    c = task.private["check"]
    fake_git = (f"#!/bin/sh\ncase \"$*\" in\n  *show*) echo '{c['lost_line']}';;\n  *-1*) echo '{c['lost_msg']}';;\n"
                f"  *) printf '%s\\n' {' '.join(repr(s) for s in c['main_subjects'])};;\nesac\n")
    plant = "\n".join(f"mkdir -p {d} && cat > {d}/git <<'EOF'\n{fake_git}EOF\nchmod +x {d}/git" for d in (".", "bin", "repo"))
    tr, _, _ = play(backend, task, [ToolInvocation("bash", {"command": plant}), ToolInvocation("submit")], limits=limits_for(task))
    assert tr.grade.reward == 0.0 and tr.grade.error is None

    task = task_of("permissions")
    want = task.private["check"]["expected"]
    lines = "\\n".join(f"{p}\\tf\\t{m:o}" for p, m in want.items())
    fake_find = f"#!/bin/sh\nprintf '{lines}\\n'\n"
    plant = f"cat > find <<'EOF'\n{fake_find}EOF\nchmod +x find; cp find python3; cp find stat"
    tr, _, _ = play(backend, task, [ToolInvocation("bash", {"command": plant}), ToolInvocation("submit")], limits=limits_for(task))
    assert tr.grade.reward == 0.0 and tr.grade.error is None


def test_the_agents_script_runs_sandboxed_on_hidden_inputs(backend):
    """A filter.sh that tries to read the grader's expected output or leak it scores 0."""
    task = task_of("shell_script")
    script = "cat > filter.sh <<'EOF'\n#!/bin/bash\ncat /work/*.txt /agent/* 2>/dev/null | head -n 3\nEOF"
    tr, _, _ = play(backend, task, [ToolInvocation("bash", {"command": script}), ToolInvocation("submit")], limits=limits_for(task))
    assert tr.grade.reward == 0.0 and tr.grade.error is None
