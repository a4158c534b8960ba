"""The command executor that runs as pid 1 inside a bwrap sandbox (started by `bwrap.py`).

Runs under the host's read-only `/usr/bin/python3 -I -S` as the sandbox uid, so it has exactly the
agent's privileges: it is a convenience for speed, not a security boundary. Per request it
receives, over a unix socket, a length-prefixed body (NUL-separated: cwd, argc, argv..., env
entries...) and three fds (stdin read end, stdout and stderr write ends of pipes the host owns),
fork+execs the command with them, then SIGKILLs every other process in the pid namespace (setsid
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


def _child(cwd, argv, env, fds):
    """In the forked child: wire the pipes, reset what Python changed, exec. Never returns."""
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; children must not
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    except BaseException as e:  # exec failed: report like a shell would
        try:
            os.write(2, ("sandbox: cannot run %r: %s\n" % (argv[0] if argv else "", e)).encode())
        finally:
            os._exit(126 if isinstance(e, PermissionError) else 127)


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
    # Not dumpable: the agent (same uid) cannot open /proc/1/mem or /proc/1/fd to tamper with us.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    # As pid 1 of the namespace, signals with the default action sent from inside are dropped by
    # the kernel; Python's own SIGINT handler would make us killable by `kill -INT 1`.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
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
        pid = os.fork()
        if pid == 0:
            _child(cwd, argv, env, fds)
        for fd in fds:  # only the command may hold the pipe ends, or the host never sees EOF
            os.close(fd)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        rc = os.waitstatus_to_exitcode(status)
        try:
            os.kill(-1, signal.SIGKILL)  # every process in our pid namespace except us
        except ProcessLookupError:
            pass
        _reap_all()
        _send(ctl, str(rc).encode())


if __name__ == "__main__":
    main()
