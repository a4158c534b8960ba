"""The reasoning-gym judge worker: a separate interpreter in which `score_answer` meets the policy's answers.

Started by `envs/reasoning_gym/judge.py` as `python -I judge_worker.py` (no PYTHON* variables, no user
site, the script's directory not on sys.path: it imports reasoning-gym and the standard library, nothing
of this repository). Protocol on stdin / stdout, one JSON object per line:

    request  {"nonce": str, "dataset": str, "seed": int, "size": int, "entry": str (JSON),
              "answer": str, "timeout_s": float}
    response {"nonce": str, "score": float}
           | {"nonce": str, "error": str, "kind": "generator" | "scorer" | "timeout" | "crash"}

For each request the worker takes the dataset object (`create_dataset(dataset, seed=, size=)`, cached;
its `score_answer` may read the dataset's config) and the task's entry (question, answer, metadata as
the task generator stored them), then forks a scorer child that installs an audit hook (PEP 578) and
calls that dataset's `score_answer(answer, entry)`. The entry comes from the task, not from
regenerating it: the task set is what the policy saw (cached on disk, possibly by another process and
another run), and it costs no generation time at grading.

Why: some scorers evaluate the answer as code (countdown's `score_answer` calls sympy's `parse_expr`,
which `eval`s its input), and any scorer may loop or allocate without bound on a crafted answer.
- Code smuggled through a scorer runs only in the child, which exits after one answer: whatever it
  patches (classes, modules) is gone before the next answer is scored.
- The audit hook refuses processes, threads, sockets, signals to other processes, file writes, opening
  anything under /proc, ctypes, and frame / heap introspection and tracing, so such code can neither act
  outside the child nor read the key (only reachable through frames) and forge a score.
- The worker makes itself non-dumpable, so a child cannot read its memory through /proc either, and the
  child's stdin / stdout (the worker's request and reply pipes) are /dev/null before the scorer runs.
What it does not do: an audit hook is not a sandbox (a C extension or an interpreter bug can step around
it); the deadline, RLIMIT_AS (set by the parent) and the HMAC are what bound the damage.
"""
from __future__ import annotations

import _hashlib
import hmac
import json
import os
import select
import signal
import sys
import time

_DENY_PREFIXES = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.",
                  "pty.", "socket.", "ctypes.", "os.remove", "os.unlink", "os.rename", "os.rmdir", "os.mkdir",
                  "os.chmod", "os.chown", "os.link", "os.symlink", "os.truncate", "os.kill", "os.killpg",
                  "shutil.", "sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile",
                  "gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.putenv", "os.unsetenv", "webbrowser.",
                  "sqlite3.", "mmap.", "resource.setrlimit", "os.setuid", "os.dup2", "_thread.start_new_thread",
                  "os.fchmod", "os.utime", "signal.pthread_kill", "os.pidfd_open", "sys.remote_exec")
# Restricted attributes CPython audits as "object.__getattr__": the ones that lead to frames are refused
# (sympy itself reads functions' __code__ / __defaults__, which stay allowed).
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Refused(PermissionError):
    pass


def _audit(event: str, args: tuple) -> None:
    if event.startswith(_DENY_PREFIXES):
        raise Refused(f"refused in the judge: {event}")
    if event == "object.__getattr__" and len(args) > 1 and args[1] in _FRAME_ATTRS:
        raise Refused(f"refused in the judge: .{args[1]}")
    if event == "open":
        path, mode, flags = args[0], args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS):
            raise Refused(f"refused in the judge: open({path!r}, {mode!r}) for writing")
        if isinstance(path, (str, bytes)) and os.fsdecode(path).startswith("/proc"):
            raise Refused("refused in the judge: /proc")


def _no_dump() -> None:
    import ctypes  # trusted code, before any answer is seen

    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4 (include/uapi/linux/prctl.h)
    except (OSError, AttributeError):
        pass


def _score_in_child(ds, entry: dict, answer: str, timeout_s: float) -> tuple[str, float | str]:
    key = os.urandom(32)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the scorer child: one answer, then exit
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)  # the worker's request and reply pipes are out of the child's reach
        os.dup2(null, 0)
        os.dup2(null, 1)
        # Bound before any answer is seen: code run by the scorer may replace module attributes
        # (os.write, hmac, builtins), but not these locals, which only frames (refused) reach.
        _float, _repr, _write, _exit, _tag = float, repr, os.write, os._exit, _hashlib.hmac_digest
        code = 0
        try:
            sys.addaudithook(_audit)
            score = _float(ds.score_answer(answer, entry))
            msg = _float.__repr__(score).encode()
        except BaseException as e:  # noqa: BLE001 - reported to the parent as a scorer error
            msg = b"error:" + _repr(type(e).__name__).encode("ascii", "replace")
            code = 1
        _write(w, msg + b"|" + _tag(key, msg, "sha256").hex().encode())
        _exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout_s
    data = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return "timeout", f"no score within {timeout_s} s"
            chunk = os.read(r, 4096)
            if not chunk or len(data) > 8192:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    msg, _, tag = data.rpartition(b"|")
    if not msg or not hmac.compare_digest(tag, _hashlib.hmac_digest(key, msg, "sha256").hex().encode()):
        return "crash", "the scorer child died or sent an unauthenticated result"
    if msg.startswith(b"error:"):
        return "scorer", msg[6:].decode("utf-8", "replace")
    return "score", float(msg)


def decode_entry(text: str) -> dict:
    """JSON back to reasoning-gym's values: the task generator tags tuples and non-string-keyed dicts
    (`envs/reasoning_gym/tasks.py: encode_entry`), which scorers compare by type (arc_agi's grids)."""
    def hook(d: dict):
        if len(d) == 1 and "__tuple__" in d:
            return tuple(d["__tuple__"])
        if len(d) == 1 and "__items__" in d:
            return {k: v for k, v in d["__items__"]}
        return d

    return json.loads(text, object_hook=hook)


def serve() -> None:
    import reasoning_gym  # imported (and its caches built) before any answer is seen

    _no_dump()
    cache: dict[tuple[str, int, int], object] = {}
    out = sys.stdout
    for line in sys.stdin:
        try:
            req = json.loads(line)
            nonce = str(req["nonce"])
        except (ValueError, KeyError, TypeError):
            continue
        try:
            key = (str(req["dataset"]), int(req["seed"]), int(req["size"]))
            ds = cache.get(key)
            if ds is None:
                ds = cache[key] = reasoning_gym.create_dataset(key[0], seed=key[1], size=key[2])
            entry = decode_entry(req["entry"])
        except Exception as e:  # noqa: BLE001 - no dataset or no entry: a grading error, reported as such
            reply = {"error": f"{type(e).__name__}: {str(e)[:300]}", "kind": "generator"}
        else:
            kind, value = _score_in_child(ds, entry, str(req["answer"]), float(req.get("timeout_s", 10.0)))
            reply = {"score": value} if kind == "score" else {"error": value, "kind": kind}
        out.write(json.dumps({"nonce": nonce, **reply}) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
