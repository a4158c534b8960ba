"""Warm CadQuery worker processes for the trusted side of cad-v0 (grading and task pictures).

Importing cadquery costs 2-3 s and ~480 MB (docs/platform.md), far too much per grade, so a small pool of
worker processes keeps it imported. Each worker is `python -m envs.cad.worker`, talking
length-prefixed JSON over its stdin and a private copy of its stdout (its fd 1 is pointed at stderr
so that anything OCC prints cannot corrupt the protocol). JSON, not pickle: a worker parses
agent-produced BREP data, and a worker that misbehaved must not be able to run code in the caller.

Requests: `grade` (reference code + the agent's BREP bytes -> geometry.Comparison or a reason the
solid is invalid), `render` (code -> PNG of the four views + the solid's summary). Reference
solids are built by exec'ing the family's own reference code (trusted, from envs/cad/families.py)
and cached per worker. Each worker has an address-space limit, so a pathological solid cannot take
the host's memory.

The agent's file is hostile data, and the pool is shared by every episode of a step, so no single
file may hold a worker for long or hold other episodes up:
  * `CadWorkerPool.grade` runs the static BREP scan (kernel/brep.py) in the calling process before
    a worker is taken: a file with forged counts, instancing bombs or thousands of solids is refused
    without touching the pool; the worker scans again before OCCT parses (`geometry.load_brep`);
  * acquiring a worker has a deadline (the same one as the whole grade), so a caller never waits
    without bound; failing it raises `CadWorkerError` for that caller;
  * a grade request has its own work timeout (`work_timeout_s`, well below the grade's deadline):
    a file that passes the scan but still overruns kills its worker and raises `CadWorkerError`
    for the episode that sent it (a visible grade error), and a replacement worker starts at once
    in the background, so the other episodes find a worker again without paying its start-up;
  * a worker's reply is checked (`Comparison.check`) before anything is scored from it.

What it does not do: run agent code (that happens only in the agent's sandbox, envs/cad/kernel/
runner.py) or decide rewards (envs/cad/domain.py).
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from envs.cad.kernel import brep
from envs.cad.kernel.geometry import Comparison
from jointrl.paths import REPO_ROOT

_LEN = struct.Struct(">I")
MAX_MESSAGE_BYTES = 256 << 20
# An honest grade takes 0.01-0.1 s of kernel time (0.1 s in a warm worker with the IPC, ~10x that under
# heavy load); the scan's caps bound a hostile file to a few seconds. Past this, the file is the problem.
GRADE_WORK_TIMEOUT_S = 30.0


class CadWorkerError(RuntimeError):
    """A worker failed (crashed, timed out, or the trusted side raised): a grading error, never a 0."""


@dataclass(frozen=True)
class GradeResult:
    """valid=False (with `reason`, and `code` from geometry.NoSolidError) when the agent's file holds no
    valid solid: that scores 0."""

    valid: bool
    reason: str = ""
    comparison: Comparison | None = None
    code: str = ""


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
        self.refs: dict[str, tuple[Any, Any, Any]] = {}  # code -> (shape, Summary, Features)

    def _build(self, code: str):
        ns: dict[str, Any] = {"__name__": "__cad_reference__"}
        exec(compile(code, "<reference>", "exec"), ns)  # noqa: S102 - trusted family code only
        return self.g.to_shape(ns["result"])

    def reference(self, code: str):
        hit = self.refs.pop(code, None)
        if hit is None:
            shape = self._build(code)
            feats = self.g.features(shape, perimeters=True)
            hit = (shape, self.g.summarize(shape, feats), feats)
            if not hit[1].valid or hit[1].volume <= 0:
                raise ValueError("the reference code built an invalid solid (a family bug)")
        self.refs[code] = hit  # most recently used last
        while len(self.refs) > 256:
            self.refs.pop(next(iter(self.refs)))
        return hit

    def grade(self, req: dict) -> dict:
        # The reference first, outside the try: a failure there is the grader's (CadWorkerError), not the agent's.
        ref, ref_summary, ref_features = self.reference(req["ref_code"])
        try:
            agent = self.g.load_submission(base64.b64decode(req["brep_b64"]))
            c = self.g.compare(agent, ref, ref_summary, ref_features)
        except self.g.NoSolidError as e:
            return {"valid": False, "reason": str(e), "code": e.code}
        except Exception as e:  # noqa: BLE001 - the kernel failing on agent-made geometry: that file's fault
            return {"valid": False, "reason": f"the kernel failed on the solid ({type(e).__name__}: {e})",
                    "code": "kernel"}
        return {"valid": True, "comparison": c.__dict__}

    def render(self, req: dict) -> dict:
        shape, summary, _ = self.reference(req["code"])
        verts, tris, lines = self.g.mesh(shape)
        pic = self.render_mod.render_views(verts, tris, lines, panel=int(req.get("panel", 160)))
        return {"png_b64": base64.b64encode(pic.png).decode(), "px_per_mm": pic.px_per_mm,
                "volume": summary.volume, "bbox": list(summary.bbox), "faces": summary.faces, "holes": summary.holes}

    def render_brep(self, req: dict) -> dict:
        """One view of the agent's solid (a BREP the host has scanned), for the `render_view` tool."""
        try:
            shape = self.g.load_submission(base64.b64decode(req["brep_b64"]))
        except self.g.NoSolidError as e:
            return {"valid": False, "reason": str(e)}
        verts, tris, lines = self.g.mesh(shape)
        pic = self.render_mod.render_view(verts, tris, lines, req["view"], size=int(req["size"]))
        return {"valid": True, "png_b64": base64.b64encode(pic.png).decode()}

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
    ops = {"grade": h.grade, "render": h.render, "render_brep": h.render_brep, "ping": h.ping}
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
    """Up to `size` warm workers, started on demand; thread-safe. `close()` stops them.

    Callers wait for a free worker in arrival order, each until its own deadline. A worker that dies
    or is killed is replaced by a background start, so waiting callers get the first worker that
    becomes free, whichever it is.
    """

    def __init__(self, size: int = 2, *, start_timeout_s: float = 180.0, as_limit_mb: int = 6144,
                 work_timeout_s: float = GRADE_WORK_TIMEOUT_S) -> None:
        if size < 1:
            raise ValueError(f"CadWorkerPool size must be >= 1, got {size}")
        self.size = size
        self.start_timeout_s = start_timeout_s
        self.as_limit_mb = as_limit_mb
        self.work_timeout_s = work_timeout_s
        self._idle: list[_Worker] = []
        self._started = 0  # workers alive or being started
        self._cond = threading.Condition()
        self._closed = False
        self._all: list[_Worker] = []
        self._waiting: list[object] = []  # tickets of callers waiting for a worker, oldest first
        self.spawn_errors = 0
        self.requests = 0  # requests that took a worker (files refused by the scan never do)

    def _spawn(self) -> _Worker:
        """Start one worker (the caller has counted it in `_started`)."""
        try:
            w = _Worker(self.start_timeout_s, self.as_limit_mb)
        except BaseException:
            with self._cond:
                self._started -= 1
                self.spawn_errors += 1
                self._cond.notify_all()
            raise
        with self._cond:
            if self._closed:
                self._started -= 1
                closed = True
            else:
                self._all.append(w)
                closed = False
        if closed:
            w.kill()
            raise CadWorkerError("the CAD worker pool is closed")
        return w

    def _spawn_in_background(self) -> None:
        def run() -> None:
            try:
                w = self._spawn()
            except BaseException:  # noqa: BLE001 - counted in spawn_errors; the next caller retries inline
                return
            self._release(w)

        threading.Thread(target=run, name="cad-worker-start", daemon=True).start()

    def _acquire(self, deadline: float) -> _Worker:
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
            try:
                while True:
                    if self._closed:
                        raise CadWorkerError("the CAD worker pool is closed")
                    first = self._waiting[0] is ticket
                    if first and self._idle:
                        return self._idle.pop()
                    if first and self._started < self.size:
                        self._started += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CadWorkerError(f"no CAD worker became free in time ({self.size} busy); grade not started")
                    self._cond.wait(left)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()
        return self._spawn()  # outside the lock: a start takes seconds

    def _release(self, w: _Worker) -> None:
        with self._cond:
            if w.alive and not self._closed:
                self._idle.append(w)
                self._cond.notify_all()
                return
            self._started -= 1
            if w in self._all:
                self._all.remove(w)
            respawn = not self._closed
        w.kill()
        if respawn:
            with self._cond:
                self._started += 1
            self._spawn_in_background()

    def call(self, req: dict, timeout_s: float, *, work_timeout_s: float | None = None) -> dict:
        """Send one request; `timeout_s` bounds waiting for a worker plus the work, `work_timeout_s` the work."""
        deadline = time.monotonic() + timeout_s
        w = self._acquire(deadline)
        with self._cond:
            self.requests += 1
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CadWorkerError(f"no time left for {req.get('op')!r} after waiting {timeout_s} s for a worker")
            reply = w.call(req, left if work_timeout_s is None else min(left, work_timeout_s))
        finally:
            self._release(w)
        if not reply.get("ok"):
            raise CadWorkerError(f"CAD worker {req.get('op')!r} failed: {reply.get('error')}")
        return reply

    def grade(self, ref_code: str, brep_data: bytes, timeout_s: float = 60.0) -> GradeResult:
        """Grade the agent's BREP bytes against the reference built from `ref_code`.

        Invalid files are a GradeResult(valid=False); CadWorkerError when the grader could not finish
        (no worker in time, the work timeout, a crash, an inconsistent reply).
        """
        try:
            brep.scan(brep_data)  # here, before a worker is taken: a hostile file costs the pool nothing
        except brep.BrepRejected as e:
            return GradeResult(valid=False, reason=str(e), code="brep")
        r = self.call({"op": "grade", "ref_code": ref_code, "brep_b64": base64.b64encode(brep_data).decode()},
                      timeout_s, work_timeout_s=self.work_timeout_s)
        if not r.get("valid"):
            return GradeResult(valid=False, reason=str(r.get("reason", "")), code=str(r.get("code", "")))
        try:
            c = Comparison(**r["comparison"])
            c.check()
        except (KeyError, TypeError, ValueError) as e:
            raise CadWorkerError(f"CAD worker sent an inconsistent comparison ({e})") from None
        return GradeResult(valid=True, comparison=c)

    def render(self, code: str, panel: int = 160, timeout_s: float = 120.0) -> RenderResult:
        r = self.call({"op": "render", "code": code, "panel": panel}, timeout_s)
        return RenderResult(png=base64.b64decode(r["png_b64"]), px_per_mm=float(r["px_per_mm"]),
                            volume=float(r["volume"]), bbox=tuple(r["bbox"]), faces=int(r["faces"]),
                            holes=int(r["holes"]))

    def render_submission(self, brep_data: bytes, view: str, size: int, timeout_s: float = 60.0) -> bytes:
        """PNG of one view of the agent's BREP (scanned here first, like `grade`); ValueError naming why there is
        no picture (a rejected file, no solid); CadWorkerError when the worker could not finish."""
        try:
            brep.scan(brep_data)
        except brep.BrepRejected as e:
            raise ValueError(str(e)) from None
        r = self.call({"op": "render_brep", "brep_b64": base64.b64encode(brep_data).decode(), "view": view, "size": size},
                      timeout_s, work_timeout_s=self.work_timeout_s)
        if not r.get("valid"):
            raise ValueError(str(r.get("reason", "no solid")))
        return base64.b64decode(r["png_b64"])

    def pids(self) -> list[int]:
        with self._cond:
            return [w.proc.pid for w in self._all if w.alive]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers, self._all = self._all, []
            self._idle = []
            self._cond.notify_all()
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
