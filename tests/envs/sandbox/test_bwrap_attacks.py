"""The attack suite: what a policy under RL will try, run against the real bwrap sandbox.

Each test checks containment (the env layer turns these into a score of 0): the command ends within
its budget, nothing of the attack survives (processes of the slot uid are scanned in /proc), the
host and this pytest process are untouched, and the sandbox still works afterwards where it should.
Budgets are small (SMALL limits, 1-3 s timeouts) so the whole file stays well under a minute.
"""
from __future__ import annotations

import os
import socket
import time
import tracemalloc
from pathlib import Path

import pytest

from envs.sandbox.base import SandboxLimits
from envs.sandbox.safefs import ArtifactError
from tests.envs.sandbox.sandbox_testlib import SMALL, assert_no_process, assert_only_executor_left, host_alive, make_backend, uid_pids

pytestmark = pytest.mark.timeout(60)
from tests import REPO


@pytest.fixture(scope="module")
def backend():
    return make_backend()


@pytest.fixture()
def box(backend):
    sb = backend.open(limits=SMALL)
    yield sb
    uid = sb.uid
    sb.close()
    assert_no_process(uid)  # every attack: nothing left once the sandbox is closed
    host_alive()


def timed(box, cmd, timeout_s, **kw):
    t0 = time.monotonic()
    r = box.run(cmd, timeout_s=timeout_s, **kw)
    return r, time.monotonic() - t0


def test_fork_bomb(box):
    r, dt = timed(box, ":(){ :|:& };:", timeout_s=3)
    assert dt < 6, dt
    assert_only_executor_left(box)
    if box.cgroup_ok:  # the pids cgroup caps the sandbox, whatever the uid count says
        with open(box.cgroup.dirs[0] / "pids.max") as f:
            assert int(f.read()) == SMALL.max_procs + 2
    assert box.run("echo alive", timeout_s=5).stdout == "alive\n"


def test_memory_bomb_single_process(box):
    r, dt = timed(box, "python3 -c 'x = []\nwhile True: x.append(b\"x\" * (64 << 20))'", timeout_s=10)
    assert r.exit_code != 0 and not r.timed_out and dt < 10
    assert "MemoryError" in r.stderr  # RLIMIT_AS (512 MiB here) stops it inside the process
    assert_only_executor_left(box)


def test_memory_bomb_many_processes(backend):
    """Four 400 MiB processes fit under RLIMIT_AS each, but not under the sandbox's memory cgroup."""
    sb = backend.open(limits=SMALL)
    try:
        if not sb.cgroup_ok:
            pytest.skip("no memory cgroup on this host: only RLIMIT_AS bounds memory (per process)")
        cmd = ("for i in 1 2 3 4; do python3 -c 'import time; x = b\"y\" * (400 << 20); time.sleep(1); print(\"done\")' & done;"
               " wait")
        r, dt = timed(sb, cmd, timeout_s=8)
        assert dt < 8 and r.stdout.count("done") < 4
        mem = sb.cgroup.dirs[1]
        peak, limit = (int((mem / f"memory.{k}").read_text()) for k in ("max_usage_in_bytes", "limit_in_bytes"))
        oom_kills = int((mem / "memory.oom_control").read_text().split("oom_kill ")[1].split()[0])
        assert peak <= limit < 4 * (400 << 20) and oom_kills > 0  # the limit was hit and held
        assert_only_executor_left(sb)
        assert sb.run("echo alive", timeout_s=5).stdout == "alive\n"
    finally:
        uid = sb.uid
        sb.close()
        assert_no_process(uid)


def test_cpu_loop_hits_rlimit_cpu(backend):
    sb = backend.open(limits=SandboxLimits(cpu_seconds=1, max_output_bytes=4096))
    try:
        r, dt = timed(sb, "while :; do :; done", timeout_s=10)
        assert r.exit_code == -24 and not r.timed_out and dt < 8  # SIGXCPU after 1 s of CPU
    finally:
        sb.close()
        assert_no_process(sb.uid)


def test_cpu_loop_hits_wall_clock(box):
    r, dt = timed(box, "while :; do :; done", timeout_s=1)
    assert r.timed_out and r.exit_code == -9 and dt < 3.5


def test_sleep_forever_is_killed_with_its_namespace(box):
    r, dt = timed(box, "sleep 100000 & sleep 100000", timeout_s=1)
    assert r.timed_out and dt < 3.5
    assert not [p for p in uid_pids(box.uid)]  # nothing until the next run starts a namespace
    assert box.run("echo again", timeout_s=5).stdout == "again\n"


def test_filling_the_disk(box):
    r, _ = timed(box, "head -c 100M /dev/zero > big; echo rc=$?; for i in $(seq 20); do head -c 4M /dev/zero > f$i; done;"
                 " head -c 100M /dev/zero > /tmp/t; df -k /work /tmp | tail -2", timeout_s=10)
    assert "File size limit exceeded" in r.stderr or "rc=153" in r.stdout  # RLIMIT_FSIZE (8 MiB)
    assert "No space left on device" in r.stderr  # the 16 MiB work tmpfs
    st = os.statvfs(box.workdir_host)
    assert st.f_blocks * st.f_frsize <= SMALL.workdir_mb << 20
    # An empty-file flood ends at the inode cap, not at host memory.
    r2, _ = timed(box, "python3 -c '\nimport os\nn = 0\ntry:\n    while True:\n        open(f\"e{n}\", \"w\").close(); n += 1\n"
                  "except OSError as e: print(n, e.errno)'", timeout_s=10)
    n, err = r2.stdout.split()
    assert int(n) < SMALL.workdir_mb * 256 and err == "28"  # ENOSPC
    assert box.run("rm -f e* f* big; echo ok > small; cat small", timeout_s=5).stdout == "ok\n"


def test_stdout_flood_is_capped_while_draining(box):
    tracemalloc.start()
    try:
        r, dt = timed(box, "head -c 100000000 /dev/zero", timeout_s=20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.exit_code == 0 and r.output_truncated and len(r.stdout) < SMALL.max_output_bytes + 100
    assert peak < 4 << 20, peak  # the host never held more than a few chunks of the 100 MB
    r2, dt2 = timed(box, "yes", timeout_s=1)  # endless flood: the wall clock ends it
    assert r2.timed_out and r2.output_truncated and dt2 < 4


def test_network_is_unreachable(box):
    # A real server on the host's loopback, outside the sandbox.
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    # And an abstract unix socket: not blocked by seccomp, only by the separate net namespace.
    usrv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract = f"jointrl-attack-{os.getpid()}"
    usrv.bind(b"\0" + abstract.encode())
    usrv.listen(4)
    usrv.settimeout(0.2)
    accepted = []

    def accept_loop():
        for s in (srv, usrv):
            try:
                accepted.append(s.accept())
            except OSError:
                pass

    try:
        code = ("import socket\n"
                "for fam, addr in ((socket.AF_INET, ('127.0.0.1', %d)), (socket.AF_INET6, ('::1', %d)),"
                " (socket.AF_UNIX, b'\\0%s')):\n"
                "    try:\n"
                "        s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(1); s.connect(addr); print('CONNECTED', fam)\n"
                "    except OSError as e: print('blocked', e.errno)\n"
                "try:\n    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
                "except OSError as e: print('dns-failed')\n") % (port, port, abstract)
        r = box.run(["python3", "-c", code], timeout_s=10)
        r2 = box.run(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED; getent hosts example.com || echo no-dns;"
                     " cat /proc/net/dev | tail -n +3 | cut -d: -f1", timeout_s=10)
        accept_loop()
    finally:
        srv.close()
        usrv.close()
    assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout, r.stdout
    assert r.stdout.split("\n")[:2] == ["blocked 97", "blocked 97"]  # EAFNOSUPPORT from seccomp
    assert r.stdout.split("\n")[2] == "blocked 111"  # ECONNREFUSED: the host's socket is not in this netns
    assert "CONNECTED" not in r2.stdout and "no-dns" in r2.stdout
    assert r2.stdout.split()[-1] == "lo"  # loopback is the only interface
    assert accepted == []


def test_host_files_are_invisible(box, tmp_path):
    secret = tmp_path / "grader_secret.txt"
    secret.write_text("THE-ANSWER-IS-42")
    os.chmod(tmp_path, 0o755)
    secret.chmod(0o644)  # world-readable on the host: only the mount namespace hides it
    probes = [str(secret), str(REPO / "pyproject.toml"), "/root", "/home", "/etc/shadow", "/etc/hostname",
              "/work/main", "/run", "/sys/kernel", "/var/log", str(Path.home())]
    r = box.run("for p in " + " ".join(probes) + "; do cat $p 2>/dev/null || ls $p 2>/dev/null || echo gone:$p; done; ls /",
                timeout_s=10)
    for p in probes:
        assert f"gone:{p}" in r.stdout, (p, r.stdout)
    assert "THE-ANSWER" not in r.stdout and "jointrl" not in r.stdout
    assert r.stdout.split("\n")[len(probes):-1] == ["bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp",
                                                     "usr", "work"]
    # grep the whole visible tree for the secret (no /proc: it is our own pid namespace only)
    r2 = box.run("grep -rs --exclude-dir=proc --exclude-dir=usr THE-ANSWER / ; echo done", timeout_s=20)
    assert r2.stdout == "done\n"


def test_writes_outside_workdir_fail(box, tmp_path):
    r = box.run("for p in /usr/evil /etc/evil /evil /dev/evil /proc/sys/kernel/hostname /lib/evil /bin/evil; do"
                " (echo x > $p) 2>/dev/null && echo WROTE:$p; done; echo x > /tmp/scratch && echo tmp-ok;"
                " echo y > /dev/shm/s && echo shm-ok; hostname evil 2>/dev/null && echo HOSTNAME", timeout_s=10)
    assert "WROTE" not in r.stdout and "HOSTNAME" not in r.stdout
    assert "tmp-ok" in r.stdout and "shm-ok" in r.stdout  # private scratch, never the host's
    assert not Path("/tmp/scratch").exists() and not Path("/evil").exists() and not Path("/usr/evil").exists()
    # private /tmp is size-limited too
    r2 = box.run("head -c 20M /dev/zero > /tmp/big; echo rc=$?", timeout_s=10)
    assert "rc=0" not in r2.stdout


def test_kill_everything(backend):
    a = backend.open(limits=SMALL)
    b = backend.open(limits=SMALL)
    try:
        b.run("sleep 30 > /dev/null &", timeout_s=5)  # a neighbour's background process... gone after run
        r = a.run("kill -9 -1; kill -9 1; kill -STOP 1; kill -INT 1; echo survived", timeout_s=5)
        assert r.stdout == "survived\n"
        host_alive()
        # pid 1 (the executor) ignores signals from inside: same namespace, no restart needed
        assert a.run("echo fine", timeout_s=5).stdout == "fine\n" and a.restarts == 0
        assert b.run("echo neighbour-fine", timeout_s=5).stdout == "neighbour-fine\n"
    finally:
        for sb in (a, b):
            sb.close()
            assert_no_process(sb.uid)


def test_daemon_left_behind(box):
    r = box.run("setsid sh -c 'sleep 1000' < /dev/null > /dev/null 2>&1 & "
                "nohup sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 & "
                "(setsid sleep 999 &) ; echo spawned", timeout_s=5)
    assert r.stdout == "spawned\n" and r.duration_s < 3
    assert_only_executor_left(box)  # gone as soon as the command returned
    box.run("setsid sleep 1000 &", timeout_s=5)
    box.kill_all()
    assert_no_process(box.uid)  # and kill_all leaves nothing at all


def test_symlink_to_host_secret(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("HOST-SECRET")
    box.run(f"ln -s {secret} link; ln -s /etc out; ln -s {tmp_path} d; mkdir real; ln -s ../d real/nested;"
            " mkfifo fifo; echo fine > ok.txt", timeout_s=5)
    box.kill_all()
    for path in ("link", "out/passwd", "d/secret.txt", "real/nested/secret.txt", "fifo", "../../etc/passwd",
                 "/etc/passwd"):
        with pytest.raises(ArtifactError):
            box.read_artifact(path)
    assert box.read_artifact("ok.txt") == b"fine\n"
    assert box.list_artifacts() == ["ok.txt"]
    # trusted writes never follow the agent's links either
    with pytest.raises(ArtifactError):
        box.write_file("d/secret.txt", b"overwritten")
    assert secret.read_text() == "HOST-SECRET"


def test_replaced_python_and_pytest_cannot_fool_the_pristine_grader(backend):
    agent = backend.open(limits=SMALL)
    grader = None
    try:
        fake = "#!/bin/sh\necho '1 passed'\necho OK\nexit 0\n"
        agent.run(f"mkdir -p bin && printf '%s' \"{fake}\" > bin/python3 && cp bin/python3 bin/pytest && chmod +x bin/*;"
                  " ln -s /work/bin/python3 python3; echo 'import sys; print(\"OK\"); sys.exit(0)' > sitecustomize.py;"
                  " echo 'wrong' > answer.txt", timeout_s=5)
        # Inside its own sandbox the agent does fool a naive check:
        fooled = agent.run("export PATH=/work/bin:$PATH; python3 check.py; pytest", timeout_s=5)
        assert fooled.exit_code == 0 and "OK" in fooled.stdout
        check = (b"import sys\n"
                 b"ans = open('/agent/answer.txt').read().strip()\n"
                 b"print('real python', sys.version_info[:2], sys.executable)\n"
                 b"sys.exit(0 if ans == 'right' else 1)\n")
        grader = backend.open_pristine(agent=agent, files={"check.py": check}, limits=SMALL)
        assert grader.uid != agent.uid
        assert "answer.txt" in grader.agent_copy.copied and "python3" not in grader.agent_copy.copied
        assert not [p for p in uid_pids(agent.uid)]  # the agent's processes died before grading
        r = grader.run("python3 check.py", timeout_s=10, env={"PATH": "/usr/bin:/bin"})
        assert r.exit_code == 1 and "real python" in r.stdout and "/usr/bin/python3" in r.stdout, r.stdout + r.stderr
        listing = grader.run("ls -la /agent /agent/bin; touch /agent/x 2>&1 || echo ro", timeout_s=5).stdout
        assert "->" not in listing and "ro" in listing  # the planted symlink was not copied; read-only
        # copies belong to host root (unmapped inside: the overflow uid), not to the grader or the agent
        assert grader.run("stat -c %u /agent/answer.txt", timeout_s=5).stdout == "65534\n"
        # the grader's own files never existed on the agent's side
        assert "check.py" not in agent.list_artifacts()
    finally:
        agent.close()
        if grader is not None:
            grader.close()
            assert_no_process(grader.uid)
        assert_no_process(agent.uid)


def test_blocked_syscalls_in_the_real_kernel(box):
    """Each syscall on the deny-list, called for real inside the sandbox, fails with the policy's errno."""
    code = r'''
import ctypes, errno, os, platform, socket
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": dict(ptrace=101, mount=165, bpf=321, io_uring_setup=425, keyctl=250, unshare=272, setns=308,
                     clone3=435, process_vm_readv=310, perf_event_open=298, userfaultfd=323, add_key=248),
      "aarch64": dict(ptrace=117, mount=40, bpf=280, io_uring_setup=425, keyctl=219, unshare=97, setns=268,
                      clone3=435, process_vm_readv=270, perf_event_open=241, userfaultfd=282, add_key=217)}[platform.machine()]
PTRACE_TRACEME, CLONE_NEWUSER, CLONE_NEWNET, KEYCTL_GET_KEYRING_ID = 0, 0x10000000, 0x40000000, 0
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr[name], *[ctypes.c_long(a) for a in args])
    return errno.errorcode.get(ctypes.get_errno(), "OK") if r == -1 else "OK"
print("ptrace", call("ptrace", PTRACE_TRACEME, 0, 0, 0))
print("mount", call("mount", 0, 0, 0, 0, 0))
print("bpf", call("bpf", 0, 0, 0))
print("io_uring_setup", call("io_uring_setup", 8, 0))
print("keyctl", call("keyctl", KEYCTL_GET_KEYRING_ID, -3, 0))
print("add_key", call("add_key", 0, 0, 0, 0, 0))
print("unshare_user", call("unshare", CLONE_NEWUSER))
print("unshare_net", call("unshare", CLONE_NEWNET))
print("setns", call("setns", 0, 0))
print("clone3", call("clone3", 0, 0))
print("process_vm_readv", call("process_vm_readv", 1, 0, 0, 0, 0, 0))
print("perf_event_open", call("perf_event_open", 0, 0, -1, -1, 0))
print("userfaultfd", call("userfaultfd", 0))
for fam in (socket.AF_INET, socket.AF_INET6):
    try:
        socket.socket(fam, socket.SOCK_DGRAM); print("inet", "OK")
    except OSError as e:
        print("inet", errno.errorcode[e.errno])
a, b = socket.socketpair(); a.send(b"x"); print("unix", "OK" if b.recv(1) == b"x" else "bad")
pid = os.fork()
if pid == 0:
    os._exit(0)
print("fork", "OK" if os.waitpid(pid, 0)[1] == 0 else "bad")
with open("/proc/self/status") as f:
    print("nnp", [l.split()[1] for l in f if l.startswith("NoNewPrivs")][0])
'''
    r = box.run(["python3", "-c", code], timeout_s=20)
    got = dict(line.split() for line in r.stdout.splitlines())
    assert got == {
        "ptrace": "EPERM", "mount": "EPERM", "bpf": "EPERM", "io_uring_setup": "EPERM", "keyctl": "EPERM",
        "add_key": "EPERM", "unshare_user": "EPERM", "unshare_net": "EPERM", "setns": "EPERM", "clone3": "ENOSYS",
        "process_vm_readv": "EPERM", "perf_event_open": "EPERM", "userfaultfd": "EPERM",
        "inet": "EAFNOSUPPORT", "unix": "OK", "fork": "OK", "nnp": "1"}, r.stdout + r.stderr
    # and the shell-level view: no nested user namespace
    r2 = box.run("unshare -Ur true 2>/dev/null || echo no-userns", timeout_s=10)
    assert r2.stdout == "no-userns\n"


def test_crashed_owner_is_swept(backend):
    """A process that dies without close() leaves a mount and a cgroup; the next owner cleans them."""
    import subprocess
    import sys

    code = ("import os; from envs.sandbox.bwrap import BwrapBackend;"
            "b = BwrapBackend(); s = b.open(); s.run('echo stale > stale.txt; sleep 300 &', timeout_s=10);"
            "print(s.uid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    uid = int(out.stdout.split()[0])
    slot_dir = backend.config.state_dir / f"slot-{uid}"
    assert os.path.ismount(slot_dir)  # the crash left its work dir behind...
    assert uid in backend.sweep_stale()  # ...and a sweep takes it away
    assert not os.path.ismount(slot_dir)
    assert_no_process(uid)
    from envs.sandbox import hostctl

    assert not hostctl.SlotCgroup.remove_stale(f"jointrl-slot-{uid}")  # no cgroup left either


def test_runs_on_rlimits_alone_without_cgroups(caplog):
    from envs.sandbox import hostctl
    from envs.sandbox.bwrap import BwrapBackend, BwrapConfig

    make_backend()
    cg = hostctl.SlotCgroup("jointrl-test-nocg", max_pids=10, memory_bytes=1 << 30, root=Path("/nonexistent"))
    assert not cg.ok and cg.why  # an unusable hierarchy is reported, not raised
    b = BwrapBackend(BwrapConfig(use_cgroups=False))
    sb = b.open(limits=SMALL)
    try:
        assert not sb.cgroup_ok
        r, dt = timed(sb, ":(){ :|:& };:", timeout_s=2)  # RLIMIT_NPROC holds it; the wall clock ends it
        assert dt < 5
        assert sb.run("echo ok", timeout_s=10).stdout == "ok\n"
    finally:
        sb.close()
        assert_no_process(sb.uid)


def test_without_root_the_backend_is_rootless_or_refuses_with_what_to_change(monkeypatch):
    from envs.sandbox.base import SandboxUnavailable
    from envs.sandbox.bwrap import BwrapBackend
    from envs.sandbox.rootless import RootlessBwrapBackend

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    try:
        backend = BwrapBackend()
    except SandboxUnavailable as e:  # no user namespaces here: the refusal says what to change
        assert "not root" in str(e) and "refusing to run commands unsandboxed" in str(e)
    else:
        assert isinstance(backend, RootlessBwrapBackend)
    with pytest.raises(SandboxUnavailable, match="needs root"):  # the root backend itself never runs without root
        object.__new__(BwrapBackend).__init__()
