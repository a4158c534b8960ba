"""Warm CadQuery worker processes for the trusted side of cad-v0 (grading and task pictures).

Importing cadquery costs 2-3 s and ~480 MB (docs/platform.md), far too much per grade, so a small pool of
worker processes keeps it imported. Each worker is `python -m envs.cad.worker`, talking
length-prefixed JSON over its stdin and a private copy of its stdout (its fd 1 is pointed at stderr
so that anything OCC prints cannot corrupt the protocol). JSON, not pickle: a worker parses
agent-produced BREP data, and a worker that misbehaved must not be able to run code in the caller.

Requests: `grade` (reference code + the agent's BREP bytes -> geometry.Comparison or a reason the
solid is invalid), `render` (code -> PNG of the four views + the solid's summary). Reference
solids are built by exec'ing the family's own reference code (trusted, from envs/cad/families.py)
and cached per worker. A request that overruns its timeout kills its worker (a fresh one starts on
the next request), and the call raises `CadWorkerError`; each worker also has an address-space
limit, so a pathological solid cannot take the host's memory.

What it does not do: run agent code (that happens only in the agent's sandbox, envs/cad/kernel/
runner.py) or decide rewards (envs/cad/domain.py).
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.cad.kernel.geometry import Comparison
from jointrl.paths import REPO_ROOT

_LEN = struct.Struct(">I")
MAX_MESSAGE_BYTES = 256 << 20


class CadWorkerError(RuntimeError):
    """A worker failed (crashed, timed out, or the trusted side raised): a grading error, never a 0."""


@dataclass(frozen=True)
class GradeResult:
    """valid=False (with `reason`) when the agent's file holds no valid solid: that scores 0."""

    valid: bool
    reason: str = ""
    comparison: Comparison | None = None


@dataclass(frozen=True)
class RenderResult:
    png: bytes
    px_per_mm: float
    volume: float
    bbox: tuple[float, float, float, float, float, float]
    faces: int
    holes: int


# ----------------------------------------------------------------------------- wire format
def _write_msg(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    buf = _LEN.pack(len(data)) + data
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                raise TimeoutError
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _read_msg(fd: int, deadline: float | None = None) -> dict:
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    if n > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {n} bytes exceeds the {MAX_MESSAGE_BYTES} limit")
    return json.loads(_read_exact(fd, n, deadline))


# ----------------------------------------------------------------------------- the worker process
class _Handlers:
    """Runs inside the worker process only (imports cadquery)."""

    def __init__(self) -> None:
        import cadquery  # noqa: F401 - the point of the warm worker: import once

        from envs.cad import render
        from envs.cad.kernel import geometry

        self.g = geometry
        self.render_mod = render
        self.refs: dict[str, tuple[Any, Any]] = {}

    def _build(self, code: str):
        ns: dict[str, Any] = {"__name__": "__cad_reference__"}
        exec(compile(code, "<reference>", "exec"), ns)  # noqa: S102 - trusted family code only
        return self.g.to_shape(ns["result"])

    def reference(self, code: str):
        hit = self.refs.pop(code, None)
        if hit is None:
            shape = self._build(code)
            hit = (shape, self.g.summarize(shape))
            if not hit[1].valid or hit[1].volume <= 0:
                raise ValueError("the reference code built an invalid solid (a family bug)")
        self.refs[code] = hit  # most recently used last
        while len(self.refs) > 256:
            self.refs.pop(next(iter(self.refs)))
        return hit

    def grade(self, req: dict) -> dict:
        ref, ref_summary = self.reference(req["ref_code"])
        try:
            shape = self.g.load_brep(base64.b64decode(req["brep_b64"]))
            solids = shape.Solids()
            if not solids:
                return {"valid": False, "reason": "the file holds no solid"}
            agent = self.g.to_shape(solids)
        except self.g.NoSolidError as e:
            return {"valid": False, "reason": str(e)}
        if not agent.isValid():
            return {"valid": False, "reason": "the solid fails the B-rep validity check"}
        if agent.Volume() <= 0:
            return {"valid": False, "reason": "the solid has no positive volume"}
        c = self.g.compare(agent, ref, ref_summary)
        return {"valid": True, "comparison": c.__dict__}

    def render(self, req: dict) -> dict:
        shape, summary = self.reference(req["code"])
        verts, tris, lines = self.g.mesh(shape)
        pic = self.render_mod.render_views(verts, tris, lines, panel=int(req.get("panel", 160)))
        return {"png_b64": base64.b64encode(pic.png).decode(), "px_per_mm": pic.px_per_mm,
                "volume": summary.volume, "bbox": list(summary.bbox), "faces": summary.faces, "holes": summary.holes}

    def ping(self, req: dict) -> dict:
        return {"pid": os.getpid()}


def worker_main() -> int:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # OCC and friends print to fd 1: send that to stderr, keep out_fd for replies
    in_fd = sys.stdin.fileno()
    limit_mb = int(os.environ.get("JOINTRL_CAD_WORKER_AS_MB", "0"))
    if limit_mb > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    h = _Handlers()
    _write_msg(out_fd, {"ready": True, "pid": os.getpid()})
    ops = {"grade": h.grade, "render": h.render, "ping": h.ping}
    while True:
        try:
            req = _read_msg(in_fd)
        except EOFError:
            return 0
        op = req.get("op")
        try:
            if op not in ops:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, **ops[op](req)}
        except BaseException as e:  # noqa: BLE001 - reported to the caller, who raises CadWorkerError
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _write_msg(out_fd, reply)


# ----------------------------------------------------------------------------- the pool (host side)
class _Worker:
    def __init__(self, start_timeout_s: float, as_limit_mb: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["JOINTRL_CAD_WORKER_AS_MB"] = str(as_limit_mb)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", "envs.cad.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=str(REPO_ROOT))
        try:
            hello = _read_msg(self.proc.stdout.fileno(), time.monotonic() + start_timeout_s)
        except (TimeoutError, EOFError, ValueError) as e:
            self.kill()
            raise CadWorkerError(f"CAD worker did not start within {start_timeout_s} s ({type(e).__name__}); "
                                 f"is cadquery importable by {sys.executable}?") from None
        if not hello.get("ready"):
            self.kill()
            raise CadWorkerError(f"CAD worker sent {hello!r} instead of ready")

    def call(self, req: dict, timeout_s: float) -> dict:
        try:
            _write_msg(self.proc.stdin.fileno(), req)
            return _read_msg(self.proc.stdout.fileno(), time.monotonic() + timeout_s)
        except TimeoutError:
            self.kill()
            raise CadWorkerError(f"CAD worker request {req.get('op')!r} exceeded {timeout_s} s; worker killed") from None
        except (EOFError, BrokenPipeError, OSError, ValueError) as e:
            self.kill()
            raise CadWorkerError(f"CAD worker died during {req.get('op')!r} ({type(e).__name__}: {e})") from None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class CadWorkerPool:
    """Up to `size` warm workers, started on demand; thread-safe. `close()` stops them."""

    def __init__(self, size: int = 2, *, start_timeout_s: float = 180.0, as_limit_mb: int = 6144) -> None:
        if size < 1:
            raise ValueError(f"CadWorkerPool size must be >= 1, got {size}")
        self.size = size
        self.start_timeout_s = start_timeout_s
        self.as_limit_mb = as_limit_mb
        self._idle: "queue.LifoQueue[_Worker]" = queue.LifoQueue()
        self._started = 0
        self._lock = threading.Lock()
        self._closed = False
        self._all: list[_Worker] = []

    def _acquire(self) -> _Worker:
        while True:
            with self._lock:
                if self._closed:
                    raise CadWorkerError("the CAD worker pool is closed")
                try:
                    return self._idle.get_nowait()
                except queue.Empty:
                    spawn = self._started < self.size
                    if spawn:
                        self._started += 1
            if spawn:
                try:
                    w = _Worker(self.start_timeout_s, self.as_limit_mb)
                except BaseException:
                    with self._lock:
                        self._started -= 1
                    raise
                with self._lock:
                    self._all.append(w)
                return w
            try:
                return self._idle.get(timeout=1.0)
            except queue.Empty:
                continue

    def _release(self, w: _Worker) -> None:
        with self._lock:
            if w.alive and not self._closed:
                self._idle.put(w)
                return
            self._started -= 1
            if w in self._all:
                self._all.remove(w)
        w.kill()

    def call(self, req: dict, timeout_s: float) -> dict:
        w = self._acquire()
        try:
            reply = w.call(req, timeout_s)
        finally:
            self._release(w)
        if not reply.get("ok"):
            raise CadWorkerError(f"CAD worker {req.get('op')!r} failed: {reply.get('error')}")
        return reply

    def grade(self, ref_code: str, brep: bytes, timeout_s: float = 60.0) -> GradeResult:
        r = self.call({"op": "grade", "ref_code": ref_code, "brep_b64": base64.b64encode(brep).decode()}, timeout_s)
        if not r["valid"]:
            return GradeResult(valid=False, reason=r["reason"])
        return GradeResult(valid=True, comparison=Comparison(**r["comparison"]))

    def render(self, code: str, panel: int = 160, timeout_s: float = 120.0) -> RenderResult:
        r = self.call({"op": "render", "code": code, "panel": panel}, timeout_s)
        return RenderResult(png=base64.b64decode(r["png_b64"]), px_per_mm=float(r["px_per_mm"]),
                            volume=float(r["volume"]), bbox=tuple(r["bbox"]), faces=int(r["faces"]),
                            holes=int(r["holes"]))

    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all if w.alive]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for w in workers:
            w.kill()


_DEFAULT: CadWorkerPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> CadWorkerPool:
    """The process-wide pool (size from $JOINTRL_CAD_WORKERS, default 2), closed at exit."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = CadWorkerPool(size=int(os.environ.get("JOINTRL_CAD_WORKERS", "2")))
            atexit.register(_DEFAULT.close)
        return _DEFAULT


if __name__ == "__main__":
    sys.exit(worker_main())
