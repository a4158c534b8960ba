"""The command executor that runs as pid 1 inside a bwrap sandbox (started by `bwrap.py`).

Runs under the host's read-only `/usr/bin/python3 -I -S` as the sandbox uid, so it has exactly the
agent's privileges: it is a convenience for speed, not a security boundary. Per request it
receives, over a unix socket, a length-prefixed body (NUL-separated: cwd, argc, argv..., env
entries...) and three fds (stdin read end, stdout and stderr write ends of pipes the host owns),
spawns the command with them, then SIGKILLs every other process in the pid namespace (setsid
daemons, background jobs), reaps them and replies with the exit status (negative: killed by that
signal). The host enforces everything that matters (wall-clock kill of the whole namespace, output
caps, rlimits, cgroups); if this process misbehaves or dies, the host kills the namespace and starts
a fresh one. Standard library only, and few imports: start-up time is paid once per sandbox.
"""
import _socket
import ctypes
import os
import signal
import struct
import sys

PR_SET_DUMPABLE = 4
_FDS_SPACE = _socket.CMSG_SPACE(3 * 4)


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _send(sock, body):
    sock.sendall(struct.pack("<I", len(body)) + body)


def _recv_request(sock):
    """(cwd, argv, env, [stdin, stdout, stderr] fds) or None at EOF."""
    data, ancdata, _, _ = sock.recvmsg(4, _FDS_SPACE)
    fds = []
    for level, kind, payload in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += struct.unpack("%di" % (len(payload) // 4), payload[: len(payload) - len(payload) % 4])
    if not data:
        return None
    data += _recv_exact(sock, 4 - len(data))
    (n,) = struct.unpack("<I", data)
    parts = _recv_exact(sock, n).decode("utf-8", "surrogateescape").split("\0")
    cwd, argc = parts[0], int(parts[1])
    argv = parts[2:2 + argc]
    env = dict(kv.split("=", 1) for kv in parts[2 + argc:] if "=" in kv)
    return cwd, argv, env, fds


def _spawn(cwd, argv, env, fds):
    """Start the command on the given pipes: (pid, None), or (None, exit code) after reporting a failure.

    posix_spawn (vfork-based in glibc) rather than os.fork: a forked Python child copy-on-write
    faults on every page it touches, which costs more than the command itself.
    """
    try:
        os.chdir(cwd)  # single-threaded, so changing our own cwd is the simplest spawn "chdir"
        actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)]
        # Python ignores SIGPIPE and SIGXFSZ; the command must get the default actions back.
        return os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True,
                               setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)), None
    except OSError as e:
        try:
            os.write(fds[2], ("sandbox: cannot run %r: %s\n" % (argv[0], e)).encode())
        except OSError:
            pass
        return None, (126 if isinstance(e, PermissionError) else 127)  # as a shell reports it


def _cloexec_all():
    """Everything we hold (the control socket, fds bwrap passed on) must not leak into commands."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass


def _reap_all():
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def main():
    ctl = _socket.socket(fileno=int(sys.argv[1]))
    if len(sys.argv) > 2:
        # Rootless sandboxes: the process limit is set here, inside the sandbox's user namespace, where the
        # kernel counts only this namespace's processes (on the host it would count every process of the user).
        import resource

        n = int(sys.argv[2])
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    # Not dumpable: the agent (same uid) cannot open /proc/1/mem or /proc/1/fd to tamper with us.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    # As pid 1 of the namespace, signals with the default action sent from inside are dropped by
    # the kernel; Python's own SIGINT handler would make us killable by `kill -INT 1`.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _cloexec_all()
    _send(ctl, b"ready")
    while True:
        try:
            req = _recv_request(ctl)
        except EOFError:
            return
        if req is None:
            return
        cwd, argv, env, fds = req
        if len(fds) != 3 or not argv:
            return
        for fd in fds:
            os.set_inheritable(fd, False)  # the command gets them as 0/1/2 only
        pid, rc = _spawn(cwd, argv, env, fds)
        for fd in fds:  # only the command may hold the pipe ends, or the host never sees EOF
            os.close(fd)
        while pid is not None:
            try:
                _, status = os.waitpid(pid, 0)
                rc = os.waitstatus_to_exitcode(status)
                break
            except InterruptedError:
                continue
        try:
            os.kill(-1, signal.SIGKILL)  # every process in our pid namespace except us
        except ProcessLookupError:
            pass
        _reap_all()
        _send(ctl, str(rc).encode())


if __name__ == "__main__":
    main()
