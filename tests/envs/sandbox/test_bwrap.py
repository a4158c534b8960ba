"""Functional tests of the bwrap backend: what commands see, persistence, output capture, lifecycle.

The attacks live in test_sandbox_attacks.py; this file checks the sandbox is usable and its
plumbing is right (real bubblewrap, real namespaces; skipped only where the backend cannot exist).
"""
from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from envs.sandbox.base import Mount, SandboxLimits, SandboxUnavailable
from tests.envs.sandbox.sandbox_testlib import SMALL, assert_no_process, make_backend, uid_pids
from tests import REPO

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def backend():
    return make_backend()


@pytest.fixture()
def box(backend):
    sb = backend.open(limits=SMALL, files={"hello.txt": b"hello\n", "bin/tool.sh": b"#!/bin/sh\necho tool\n"})
    yield sb
    sb.close()


def test_basic_command_env_and_identity(box):
    r = box.run("id -u; pwd; cat hello.txt; env | sort", timeout_s=10)
    assert r.exit_code == 0 and not r.timed_out and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == str(box.uid) and lines[1] == "/work" and lines[2] == "hello"
    env = dict(line.split("=", 1) for line in lines[3:])
    # Only what we set (bash adds PWD, SHLVL and `_` itself).
    assert {k: env[k] for k in ("PATH", "HOME", "LANG")} == {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8"}
    assert set(env) <= {"PATH", "HOME", "LANG", "PWD", "SHLVL", "_"}


def test_exit_codes_stdin_argv_cwd_env(box):
    assert box.run("exit 7", timeout_s=10).exit_code == 7
    assert box.run("kill -TERM $$", timeout_s=10).exit_code == -15
    assert box.run(["cat"], timeout_s=10, stdin=b"abc").stdout == "abc"
    big = random.Random(0).randbytes(300_000)  # > the 64 KiB pipe buffer: exercises the writer
    r = box.run("sha256sum", timeout_s=10, stdin=big)
    import hashlib

    assert r.stdout.split()[0] == hashlib.sha256(big).hexdigest()
    assert box.run(["sh", "bin/tool.sh"], timeout_s=10).stdout == "tool\n"
    assert box.run("pwd", timeout_s=10, cwd="bin").stdout == "/work/bin\n"
    assert box.run("echo $FOO", timeout_s=10, env={"FOO": "bar"}).stdout == "bar\n"
    r = box.run(["/no/such/binary"], timeout_s=10)
    assert r.exit_code == 127 and "cannot run" in r.stderr
    with pytest.raises(ValueError):
        box.run("true", timeout_s=0)
    with pytest.raises(TypeError):
        box.run([], timeout_s=1)


def test_large_and_unicode_commands(box):
    long_cmd = "echo " + "x" * 100_000 + " | wc -c"  # the env layer caps arguments at 100k chars
    assert box.run(long_cmd, timeout_s=10).stdout.strip() == "100001"
    assert box.run("echo 'héllo ✓'", timeout_s=10).stdout == "héllo ✓\n"
    r = box.run("printf '\\xff\\xfe'", timeout_s=10)  # invalid UTF-8 output is replaced, not raised
    assert r.exit_code == 0 and r.stdout == "\ufffd\ufffd"


def test_workdir_persists_and_files_belong_to_slot_uid(box):
    box.run("mkdir -p out && echo 42 > out/answer && chmod 600 out/answer", timeout_s=10)
    assert box.run("cat out/answer", timeout_s=10).stdout == "42\n"
    st = os.stat(box.workdir_host / "out" / "answer")
    assert st.st_uid == box.uid and stat.S_IMODE(st.st_mode) == 0o600
    assert os.stat(box.workdir_host / "hello.txt").st_uid == box.uid  # set-up files too
    assert box.read_artifact("out/answer") == b"42\n"
    s = box.stat_artifact("out/answer")
    assert (s.kind, s.mode, s.size, s.uid) == ("file", 0o600, 3, box.uid)
    assert box.list_artifacts() == ["bin/tool.sh", "hello.txt", "out/answer"]
    box.write_file("late.txt", b"late")
    assert box.run("cat late.txt", timeout_s=10).stdout == "late"


def test_common_tools_work(box):
    r = box.run("awk 'BEGIN{print 6*7}'; printf 'b\\na\\n' | sort | head -1; sqlite3 :memory: 'select 1+1'; "
                "git init -q repo && echo ok; python3 -c 'print(3)'; tar cf x.tar hello.txt && echo tar",
                timeout_s=20)
    assert r.stdout.split() == ["42", "a", "2", "ok", "3", "tar"], r.stderr


def test_output_cap_keeps_head_and_tail(box):
    cap = SMALL.max_output_bytes
    r = box.run(f"echo START; head -c {5 * cap} /dev/zero | tr '\\0' x; echo; echo END", timeout_s=10)
    assert r.output_truncated and r.exit_code == 0
    assert r.stdout.startswith("START\n") and r.stdout.endswith("END\n")
    assert "bytes of output dropped" in r.stdout and len(r.stdout) < cap + 100
    small = box.run("echo -n hi; echo -n err >&2", timeout_s=10)
    assert (small.stdout, small.stderr, small.output_truncated) == ("hi", "err", False)


def test_capture_against_reference():
    """`_Capture` keeps exactly head = first cap//2 bytes and tail = last cap - cap//2 (or everything)."""
    from envs.sandbox.bwrap import _Capture

    rng = random.Random(1)
    for _ in range(200):
        cap = rng.choice([1, 2, 7, 64, 1000])
        n_bytes = rng.randrange(0, 3 * cap + 150_000 if rng.random() < 0.1 else 3 * cap + 5)
        data = bytes(rng.choice(b"abcdef") for _ in range(n_bytes))
        c = _Capture(cap)
        i = 0
        while i < len(data):
            n = rng.randrange(1, 70_000)
            c.add(data[i:i + n])
            i += n
        if len(data) <= cap:
            assert c.text() == data.decode() and not c.truncated
        else:
            h, t = cap // 2, cap - cap // 2
            want = data[:h].decode() + f"\n[... {len(data) - h - t} bytes of output dropped ...]\n" + (data[-t:].decode() if t else "")
            assert c.text() == want and c.truncated


def test_timeout_restarts_namespace_but_keeps_workdir(box):
    box.run("echo keep > k.txt; echo scratch > /tmp/s", timeout_s=10)
    t0 = time.monotonic()
    r = box.run("sleep 30", timeout_s=0.5)
    assert r.timed_out and r.exit_code == -9 and time.monotonic() - t0 < 3
    r2 = box.run("cat k.txt; cat /tmp/s 2>/dev/null || echo tmp-gone", timeout_s=10)
    assert r2.stdout == "keep\ntmp-gone\n" and box.restarts == 1


def test_survives_the_opening_thread_exiting(backend):
    """bwrap's --die-with-parent follows the *thread* that forked it; the backend forks from its own
    long-lived thread, so a sandbox opened from a short-lived worker thread keeps its namespace."""
    holder = []
    t = threading.Thread(target=lambda: holder.append(backend.open(limits=SMALL, files={"f": b"kept"})))
    t.start()
    t.join()
    sb = holder[0]
    try:
        time.sleep(0.2)  # give a wrongly-delivered parent-death signal time to land
        r = sb.run("cat f", timeout_s=10)
        assert r.stdout == "kept" and r.exit_code == 0 and sb.restarts == 0
    finally:
        sb.close()


def test_close_is_idempotent_and_leaves_nothing(backend):
    sb = backend.open(limits=SMALL)
    uid, slot_dir = sb.uid, sb.slot_dir
    sb.run("sleep 100 & echo started", timeout_s=10)
    assert uid_pids(uid)
    sb.close()
    sb.close()
    assert_no_process(uid)
    assert not os.path.ismount(slot_dir)
    with pytest.raises(RuntimeError, match="closed"):
        sb.run("true", timeout_s=1)


def test_close_from_another_thread_interrupts_a_running_command(backend):
    sb = backend.open(limits=SMALL)
    results = []
    t = threading.Thread(target=lambda: results.append(sb.run("sleep 60", timeout_s=60)))
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    sb.close()
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert results[0].exit_code == -9
    assert_no_process(sb.uid)


def test_concurrent_sandboxes_are_isolated(backend):
    boxes = [backend.open(limits=SMALL) for _ in range(3)]
    try:
        assert len({b.uid for b in boxes}) == 3
        outs: dict[int, str] = {}

        def work(i, b):
            b.run(f"echo {i} > mine.txt", timeout_s=10)
            outs[i] = b.run("ls /work; cat mine.txt; ls /proc | grep -c '^[0-9]'", timeout_s=10).stdout

        threads = [threading.Thread(target=work, args=(i, b)) for i, b in enumerate(boxes)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for i in range(3):
            # only its own file; and only its own processes are visible (executor, bash, ls/grep)
            lines = outs[i].split()
            assert lines[:2] == ["mine.txt", str(i)]
            assert int(lines[2]) <= 5
    finally:
        for b in boxes:
            b.close()


def test_slots_exclusive_across_processes(backend):
    """Another process's backend never hands out a uid that is live here."""
    sb = backend.open(limits=SMALL)
    try:
        code = ("from envs.sandbox.bwrap import BwrapBackend; from envs.sandbox.base import SandboxLimits;"
                "b = BwrapBackend(); s = b.open(limits=SandboxLimits(workdir_mb=4)); print(s.uid);"
                "print(s.run('id -u', timeout_s=10).stdout.strip()); s.close()")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=REPO).stdout.split()
        assert len(out) == 2 and out[0] == out[1] and int(out[0]) != sb.uid
        assert sb.run("echo still-mine", timeout_s=10).stdout == "still-mine\n"
    finally:
        sb.close()


def test_extra_mount_is_read_only(backend, tmp_path):
    (tmp_path / "data.txt").write_text("shared data")
    os.chmod(tmp_path, 0o755)  # mounted content keeps its host permissions: it must be world-readable
    sb = backend.open(limits=SMALL, mounts=(Mount(host=tmp_path, inside="/opt/data"),))
    try:
        r = sb.run("cat /opt/data/data.txt; echo x > /opt/data/new 2>&1 || echo refused", timeout_s=10)
        assert r.stdout.startswith("shared data") and "refused" in r.stdout
        assert not (tmp_path / "new").exists()
    finally:
        sb.close()
    for bad in ("/work/x", "/usr/lib/x", "relative", "/"):
        with pytest.raises(ValueError):
            backend.open(limits=SMALL, mounts=(Mount(host=tmp_path, inside=bad),))


def test_project_venv_usable_through_a_mount(backend):
    """Graders can run the project's pytest by mounting the venv and its base interpreter read-only."""
    venv = Path(sys.prefix)
    base = Path(sys.base_prefix)
    if not str(base).startswith("/usr") and base.parts[1] in ("work", "proc", "dev", "tmp", "etc"):
        pytest.skip(f"base interpreter at {base} cannot be mounted at its own path")
    mounts = (Mount(host=venv, inside="/opt/venv"),)
    if not str(base).startswith("/usr"):
        mounts += (Mount(host=base, inside=str(base)),)
    sb = backend.open(limits=SandboxLimits(address_space_mb=4096), mounts=mounts,
                      files={"test_t.py": b"def test_ok():\n    assert 1 + 1 == 2\n"})
    try:
        r = sb.run("/opt/venv/bin/python -m pytest -q -p no:cacheprovider test_t.py", timeout_s=60)
        assert r.exit_code == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
    finally:
        sb.close()


def test_bad_limits_and_network_refused(backend):
    with pytest.raises(ValueError, match="workdir_mb"):
        backend.open(limits=SandboxLimits(workdir_mb=0))
    with pytest.raises(SandboxUnavailable, match="network"):
        backend.open(network=True)


def test_bwrap_failure_is_sandbox_unavailable():
    """If bubblewrap cannot build the namespaces, open() raises with its message: never unsandboxed."""
    import shutil
    import tempfile

    from envs.sandbox.bwrap import BwrapBackend, BwrapConfig

    make_backend()  # skip where the backend cannot exist at all
    d = Path(tempfile.mkdtemp(prefix="fakebwrap-"))
    try:
        os.chmod(d, 0o755)  # the slot uid must be able to exec it
        fake = d / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        b = BwrapBackend(BwrapConfig(bwrap=str(fake)))
        with pytest.raises(SandboxUnavailable, match="No permissions to creating new namespace"):
            b.open(limits=SMALL)
    finally:
        shutil.rmtree(d)
