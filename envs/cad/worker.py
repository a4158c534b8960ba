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
  * waiting callers are served cheapest first (`grade_cost`, from the scan's counts), and files outside
    the plain envelope (`PLAIN`) hold at most `size - 1` workers at once, so an honest file waits only
    for files no costlier than itself, never behind a queue of expensive ones;
  * acquiring a worker has a deadline (the same one as the whole grade), so a caller never waits
    without bound; failing it raises `CadWorkerError` for a plain file and is the file's own 0
    (`cost`) for a heavy one;
  * a heavy file is graded in a child forked from the warm worker, under a CPU-time cap (RLIMIT_CPU) and
    a wall cap: past either it scores 0 (`cost`), charged to it, and the worker lives on (`forked`);
  * a plain grade has its own work timeout (`work_timeout_s`, well below the grade's deadline):
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


@dataclass(frozen=True)
class PlainEnvelope:
    """Files the pool grades in the worker's own process, on any worker: no BSpline poles and at most this
    many solids, faces and edge uses (fusing a few solids of 48 faces in all is as cheap as one). Every
    family's part sits well inside (one solid, 4-26 faces, 20-130 edge uses, no poles), and a file this
    small on analytic surfaces grades in ~0.01-0.1 s. Anything else is "heavy":
    on at most `size - 1` workers at once, in a forked child with a CPU-time cap charged to the file
    (`CadWorkerPool`). Both kinds wait in one queue ordered by `grade_cost`."""

    max_solids: int = 4
    max_faces: int = 48
    max_edges: int = 300

    def admits(self, stats: brep.BrepStats) -> bool:
        return (stats.solids <= self.max_solids and stats.poles == 0 and stats.faces <= self.max_faces
                and stats.edges <= self.max_edges)


PLAIN = PlainEnvelope()
# A heavy file's grade may use this much CPU time in its forked child (RLIMIT_CPU: independent of how busy the
# machine is). The scan's caps bound a file to ~1.5 s of one idle core (docs/cad.md); past the cap the file
# scores 0 with `reject_cost`, charged to it, and the worker stays warm.
HEAVY_CPU_S = 10
# ... and this much wall time (a child starved of CPU by the rest of the machine is stopped here, also as `cost`).
HEAVY_WALL_S = 60.0
# What the host allows a worker beyond its child's wall limit: the fork (~40 ms), reaping the child, the reply.
FORK_MARGIN_S = 10.0


def grade_cost(stats: brep.BrepStats) -> int:
    """The order in which the pool serves files (lower first): edge uses and poles, plus a term for fusing
    several solids, which grows about quadratically with their faces (brep.BrepLimits' measurements)."""
    return stats.edges + stats.poles + (stats.faces * stats.faces // 16 if stats.solids > 1 else 0)


class CadWorkerError(RuntimeError):
    """A worker failed (crashed, timed out, or the trusted side raised): a grading error, never a 0."""


class CadQueueTimeout(CadWorkerError):
    """No worker became free before the request's deadline."""


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
        # The reference first, outside the try and before any fork: a failure there is the grader's
        # (CadWorkerError), not the agent's, and the warm process keeps the built reference.
        ref, ref_summary, ref_features = self.reference(req["ref_code"])

        def work() -> dict:
            try:
                agent = self.g.load_submission(base64.b64decode(req["brep_b64"]))
                c = self.g.compare(agent, ref, ref_summary, ref_features)
            except self.g.NoSolidError as e:
                return {"valid": False, "reason": str(e), "code": e.code}
            except Exception as e:  # noqa: BLE001 - the kernel failing on agent-made geometry: that file's fault
                return {"valid": False, "reason": f"the kernel failed on the solid ({type(e).__name__}: {e})",
                        "code": "kernel"}
            return {"valid": True, "comparison": c.__dict__}

        if not req.get("fork"):
            return work()
        return forked(work, int(req["cpu_s"]), float(req["wall_s"]))

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


def forked(work, cpu_s: int, wall_s: float) -> dict:
    """Run `work()` (-> a JSON-able grade reply) in a forked child of this warm worker, with RLIMIT_CPU `cpu_s`
    and `wall_s` of wall time. The child inherits the imported kernel and the cached reference (copy on write,
    ~40 ms for a ~500 MB worker), so an overrun or a crash ends the child, not the worker. Over either limit:
    {"valid": False, "code": "cost"}; killed by any other signal (the kernel crashed on the file): "crash"."""
    import resource
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, write the reply, leave without running the parent's cleanup
        try:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # soft: SIGXCPU; hard: SIGKILL
            data = json.dumps(work()).encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    out, over = bytearray(), False
    deadline = time.monotonic() + wall_s
    try:
        while True:
            left = deadline - time.monotonic()
            ready = select.select([r], [], [], left)[0] if left > 0 else []
            if not ready:
                over = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            out += chunk
    finally:
        os.close(r)
    _, status, usage = os.wait4(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    if over or sig in (signal.SIGXCPU, signal.SIGKILL):
        used = usage.ru_utime + usage.ru_stime
        return {"valid": False, "code": "cost",
                "reason": f"grading this solid took more than its {cpu_s} s of CPU time or {wall_s:.0f} s of wall time "
                          f"(stopped after {used:.1f} s of CPU); a part this complex is charged its own cost: simplify it"}
    if sig or not out:
        return {"valid": False, "code": "crash", "reason": f"the kernel crashed on the solid (signal {sig})"}
    return json.loads(bytes(out))


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


@dataclass(order=True)
class _Waiter:
    cost: int
    seq: int
    heavy: bool = False


class CadWorkerPool:
    """Up to `size` warm workers, started on demand; thread-safe. `close()` stops them.

    Callers wait for a free worker, each until its own deadline, served cheapest first: by the cost the
    static scan reads from the file (`grade_cost`), then in arrival order. Files outside the plain
    envelope (`PLAIN`) are heavy: they may hold at most `heavy_slots` workers at once (`size - 1`, at
    least 1), so with two or more workers one is always left to plain files, and they are graded in a
    forked child with a CPU cap (`HEAVY_CPU_S`) whose overrun is the file's own 0 (`reject_cost`), not an
    error and not a killed worker. A plain grade therefore waits only for plainer-or-equal files and at
    most one grade in progress per worker, whatever the other episodes submitted. A worker that dies
    or is killed is replaced by a background start, so waiting callers get the first worker that
    becomes free, whichever it is.
    """

    def __init__(self, size: int = 2, *, start_timeout_s: float = 180.0, as_limit_mb: int = 6144,
                 work_timeout_s: float = GRADE_WORK_TIMEOUT_S, plain: PlainEnvelope = PLAIN,
                 heavy_cpu_s: int = HEAVY_CPU_S, heavy_wall_s: float = HEAVY_WALL_S) -> None:
        if size < 1:
            raise ValueError(f"CadWorkerPool size must be >= 1, got {size}")
        if heavy_cpu_s < 1 or heavy_wall_s <= 0:
            raise ValueError(f"CadWorkerPool heavy_cpu_s must be >= 1 and heavy_wall_s > 0, got {heavy_cpu_s}, "
                             f"{heavy_wall_s}")
        self.size = size
        self.start_timeout_s = start_timeout_s
        self.as_limit_mb = as_limit_mb
        self.work_timeout_s = work_timeout_s
        self.plain = plain
        self.heavy_cpu_s = heavy_cpu_s
        self.heavy_wall_s = heavy_wall_s
        self.heavy_slots = max(1, size - 1)
        self._heavy_running = 0
        self._idle: list[_Worker] = []
        self._started = 0  # workers alive or being started
        self._cond = threading.Condition()
        self._closed = False
        self._all: list[_Worker] = []
        self._waiting: list[_Waiter] = []  # callers waiting for a worker
        self._seq = 0
        self.spawn_errors = 0
        self.requests = 0  # requests that took a worker (files refused by the scan never do)
        self.served: list[tuple[str, int]] = []  # (op, cost) of the last requests, in the order they took a worker

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

    def _next(self) -> _Waiter | None:
        """The waiter to serve next: the cheapest (then oldest) that may run now (heavy ones only while a
        heavy slot is free)."""
        ok = [x for x in self._waiting if not x.heavy or self._heavy_running < self.heavy_slots]
        return min(ok) if ok else None

    def _acquire(self, deadline: float, cost: int = 0, heavy: bool = False) -> _Worker:
        with self._cond:
            me = _Waiter(cost, self._seq, heavy)
            self._seq += 1
            self._waiting.append(me)
            try:
                while True:
                    if self._closed:
                        raise CadWorkerError("the CAD worker pool is closed")
                    if self._next() is me and (self._idle or self._started < self.size):
                        self._heavy_running += heavy
                        if self._idle:
                            return self._idle.pop()
                        self._started += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CadQueueTimeout(f"no CAD worker became free in time ({self.size} busy); grade not started")
                    self._cond.wait(left)
            finally:
                self._waiting.remove(me)
                self._cond.notify_all()
        try:
            return self._spawn()  # outside the lock: a start takes seconds
        except BaseException:
            self._done_heavy(heavy)
            raise

    def _done_heavy(self, heavy: bool) -> None:
        if heavy:
            with self._cond:
                self._heavy_running -= 1
                self._cond.notify_all()

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

    def call(self, req: dict, timeout_s: float, *, work_timeout_s: float | None = None, cost: int = 0,
             heavy: bool = False) -> dict:
        """Send one request; `timeout_s` bounds waiting for a worker plus the work, `work_timeout_s` the work;
        `cost` orders the queue (lower first), `heavy` limits the request to the heavy slots."""
        deadline = time.monotonic() + timeout_s
        w = self._acquire(deadline, cost, heavy)
        with self._cond:
            self.requests += 1
            self.served = self.served[-255:] + [(str(req.get("op")), cost)]
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CadQueueTimeout(f"no time left for {req.get('op')!r} after waiting {timeout_s} s for a worker")
            if req.get("fork"):
                # The worker stops its child at the deadline itself (the file's own `cost`), so the worker is
                # never killed for it; the host waits that long plus a margin for the fork and the reply.
                req = {**req, "wall_s": min(float(req["wall_s"]), max(0.1, left))}
                limit = req["wall_s"] + FORK_MARGIN_S
            else:
                limit = left if work_timeout_s is None else min(left, work_timeout_s)
            reply = w.call(req, limit)
        finally:
            self._release(w)
            self._done_heavy(heavy)
        if not reply.get("ok"):
            raise CadWorkerError(f"CAD worker {req.get('op')!r} failed: {reply.get('error')}")
        return reply

    def grade(self, ref_code: str, brep_data: bytes, timeout_s: float = 60.0) -> GradeResult:
        """Grade the agent's BREP bytes against the reference built from `ref_code`.

        Invalid files are a GradeResult(valid=False); CadWorkerError when the grader could not finish
        (no worker in time, the work timeout, a crash, an inconsistent reply).
        """
        try:
            stats = brep.scan(brep_data)  # here, before a worker is taken: a hostile file costs the pool nothing
        except brep.BrepRejected as e:
            return GradeResult(valid=False, reason=str(e), code="brep")
        heavy = not self.plain.admits(stats)
        req = {"op": "grade", "ref_code": ref_code, "brep_b64": base64.b64encode(brep_data).decode(), "fork": heavy,
               "cpu_s": self.heavy_cpu_s, "wall_s": self.heavy_wall_s}
        try:
            # A heavy grade's work is bounded inside the worker (the child's limits, `call`); a worker that still
            # overruns them by FORK_MARGIN_S is killed (a grade error, as for a plain file past its work timeout).
            r = self.call(req, timeout_s, cost=grade_cost(stats), heavy=heavy, work_timeout_s=self.work_timeout_s)
        except CadQueueTimeout as e:
            if not heavy:
                raise
            return GradeResult(valid=False, code="cost",
                               reason=f"this solid ({stats.faces} faces, {stats.edges} edge uses, {stats.solids} "
                                      f"solids, {stats.poles} poles) is outside the plain envelope and was not reached "
                                      f"in the grader's queue before its deadline ({e})")
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
            stats = brep.scan(brep_data)
        except brep.BrepRejected as e:
            raise ValueError(str(e)) from None
        if not self.plain.admits(stats):  # drawing is a convenience: only plain files take a worker for it
            raise ValueError(f"this solid is too complex to draw ({stats.solids} solids, {stats.faces} faces, "
                             f"{stats.edges} edge uses, {stats.poles} BSpline poles; drawn: at most "
                             f"{self.plain.max_solids} solids, {self.plain.max_faces} faces and {self.plain.max_edges} "
                             "edge uses, no BSpline surfaces); submit still grades it")
        r = self.call({"op": "render_brep", "brep_b64": base64.b64encode(brep_data).decode(), "view": view, "size": size},
                      timeout_s, work_timeout_s=self.work_timeout_s, cost=grade_cost(stats))
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
