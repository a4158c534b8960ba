"""The sandbox without root, run by an unprivileged user created here: the same isolation through user
namespaces (identity, filesystem, no network, process limit counted inside the namespace, timeouts, the
grading sandbox), the root-only limits reported as absent; and, where user namespaces are off, a refusal
that says what to change.

The test user is made with `useradd` (the test needs root for that, and skips otherwise); scripts run as that
user through `setpriv --reuid/--regid --clear-groups` under the system python3 (the venv's interpreter lives
under /root, which the user cannot read), importing the sandbox package from the repository.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
USER = "jointrl-rootless-test"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"),
                                reason="needs root (to create the unprivileged test user), useradd and setpriv")

SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from envs.sandbox.bwrap import BwrapBackend, sandbox_report
from envs.sandbox.base import SandboxLimits
out = {"report": sandbox_report(), "host_uid": os.getuid()}
backend = BwrapBackend()
out["backend"] = type(backend).__name__
box = backend.open(limits=SandboxLimits(max_procs=16))
r = lambda cmd, t=20: box.run(cmd, timeout_s=t)
out["id"] = r("id -u; id -g").stdout.split()
out["caps"] = r("grep CapEff /proc/self/status").stdout.split()[-1]
out["pids_seen"] = len([p for p in os.listdir("/proc") if p.isdigit()])
out["procs_inside"] = r("ls /proc | grep -c '^[0-9]'").stdout.strip()
out["repo_visible"] = r(f"ls {sys.argv[1]} >/dev/null 2>&1 && echo yes || echo no").stdout.strip()
out["home_visible"] = r("ls /home /root >/dev/null 2>&1 && echo yes || echo no").stdout.strip()
out["root_writable"] = r("touch /x 2>/dev/null && echo yes || echo no").stdout.strip()
out["inet"] = r("python3 -c 'import socket; socket.socket(socket.AF_INET)' 2>&1 | tail -1").stdout.strip()
out["userns"] = r("unshare -U true 2>&1; echo rc=$?").stdout.strip()
out["nproc_limit"] = r("ulimit -u").stdout.strip()
bomb = r("for i in $(seq 40); do sleep 5 & done 2>&1 | grep -c 'Resource temporarily unavailable'; true", 30)
out["forks_refused"] = int(bomb.stdout.strip() or 0)
out["timeout"] = r("sleep 100", 1).timed_out
box.write_file("answer.txt", b"42\n")
out["agent_wrote"] = r("echo agent > made.txt; cat answer.txt").stdout.strip()
grader = backend.open_pristine(agent=box)
out["grader_sees"] = grader.run("cat /agent/made.txt; touch /agent/y 2>/dev/null || echo read-only", timeout_s=20).stdout.split()
out["host_file_owner"] = os.stat(box.workdir_host / "made.txt").st_uid
grader.close(); box.close()
out["slot_dir_removed"] = not box.slot_dir.exists()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def test_user():
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        p = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                           capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"useradd failed: {p.stderr.strip()}")
        pw = pwd.getpwnam(USER)
    if not os.access(REPO, os.R_OK | os.X_OK) or (os.stat(REPO).st_mode & 0o005) != 0o005:
        pytest.skip(f"{REPO} is not readable by other users")
    return pw


def _as_user(pw, args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    return subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd="/tmp")


def test_rootless_sandbox_isolates_like_the_root_one(test_user):
    p = _as_user(test_user, ["/usr/bin/python3", "-c", SCRIPT, str(REPO)])
    if p.returncode != 0 and "user namespace" in p.stderr:
        pytest.skip(f"this machine has no unprivileged user namespaces: {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    assert out["host_uid"] == test_user.pw_uid and out["backend"] == "RootlessBwrapBackend"
    assert "absent without root" in out["report"] and "RLIMIT_AS" in out["report"]
    assert out["id"][0] != "0" and out["caps"] == "0000000000000000"
    assert out["repo_visible"] == "no" and out["home_visible"] == "no" and out["root_writable"] == "no"
    assert "Address family not supported" in out["inet"]  # the seccomp filter refuses AF_INET (as with root)
    assert "rc=0" not in out["userns"]  # no nested user namespace (seccomp + --disable-userns)
    assert out["nproc_limit"] == "17" and out["forks_refused"] > 0  # counted inside the namespace, not the user's
    assert int(out["procs_inside"]) <= 4  # the executor, the shell, ls, grep: nothing of the host
    assert out["timeout"] is True
    assert out["agent_wrote"] == "42" and out["grader_sees"] == ["agent", "read-only"]
    assert out["host_file_owner"] == test_user.pw_uid and out["slot_dir_removed"]


def test_without_user_namespaces_the_backend_refuses_with_what_to_change(test_user):
    """Inside a bubblewrap namespace made with --disable-userns no user namespace can be created: a real host
    without them, as far as the sandbox can tell."""
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from envs.sandbox.base import SandboxUnavailable\n"
            "from envs.sandbox.bwrap import BwrapBackend, sandbox_report\n"
            "try:\n    BwrapBackend()\nexcept SandboxUnavailable as e:\n    print('REFUSED', e)\n"
            "try:\n    sandbox_report()\nexcept SandboxUnavailable as e:\n    print('REPORT', e)\n")
    p = _as_user(test_user, ["bwrap", "--unshare-user", "--disable-userns", "--ro-bind", "/", "/", "--proc", "/proc",
                             "--dev", "/dev", "--tmpfs", "/tmp", "--", "/usr/bin/python3", "-c", code, str(REPO)])
    if p.returncode != 0 and not p.stdout:
        pytest.skip(f"this machine has no unprivileged user namespaces to start from: {p.stderr.strip()[-300:]}")
    lines = p.stdout.splitlines()
    assert any(x.startswith("REFUSED no sandbox: not root") for x in lines), p.stdout + p.stderr
    assert all("kernel.unprivileged_userns_clone" in x and "refusing" in x for x in lines if x.startswith("REFUSED"))
    assert any(x.startswith("REPORT not root") and "cannot run" in x for x in lines), p.stdout
