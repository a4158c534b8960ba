"""cad-v0: the agent writes CadQuery code for a described part; graded by exact-solid IoU x a feature term.

Per episode: a fresh bubblewrap sandbox (no network, read-only root, rlimits, wall-clock kill) that
sees the Python environment holding cadquery read-only (`SandboxPython`: the venv, its base
interpreter if that lives outside /usr, and envs/cad/kernel/). Both tools run the agent's code
there with `kernel/runner.py`, which reports on the agent's *own* solid only:

* `run_cad(code)`  -> the error, or volume / bounding box / faces / through-holes of `result`;
  the solid is also written as BREP (a file name the host chose for this call): the agent's current solid;
* `render_view(view)` -> a PNG (`VIEW_PX` square) of one view (top / front / right / iso) of the current
  solid, rendered by the trusted worker from that file (scanned first, like a submission), so the policy
  can compare its part with the target's views;
* `submit(code)`   -> the same run as run_cad, then ends the episode.

Grading (`check`, after `kill_all`): the submitted BREP is read back with `read_artifact` (as data:
no symlinks, size cap) and compared, in a trusted warm worker (envs/cad/worker.py), with the
reference solid built from the family's own code:

    score = IoU x (holes_ok + faces_ok + bbox_ok) / 3        (kernel/geometry.py has the definitions)

and 0 when the submitted code failed, timed out, was killed, or gave no valid solid. Nothing the
sandbox produced is trusted: the runner's report only decides what the agent is shown and whether
a file is looked for; the file is agent-made data, scanned before OCCT parses it
(kernel/brep.py) and checked as a solid before it is measured (kernel/geometry.py). An invalid
file scores 0 with a `check/reject_<code>` metric saying why. The rubric: `score` minus 0.1 x the
fraction of malformed calls; truncated episodes score 0; a grader failure (worker crash, a plain
file's work timeout, no worker within its deadline) is a visible grade error for that episode,
never a silent 0, while a file outside the plain envelope that overruns its own CPU or wall cap (or its
deadline in the queue) scores 0 with `check/reject_cost`: its cost is charged to it (envs/cad/worker.py).
IoU, each feature check and the counts are reported as `check/...` metrics.

`CadEnv` is the `ToolEnv` of cad-v0. Built with `prompt_views=True` (the runtime does so when the policy takes
images: `rollout.max_images_per_prompt` > 0), it puts the target's four views (tasks.prompt_image, 320 x 320) on
the task's user message at `reset`; what the policy then sees of them (the picture, blank pixels, a note past
the episode's image limit) is the agent loop's choice. Otherwise prompts stay text only: the picture is then
only in `Task.public`, and text-only codecs and the SFT data never meet an image.

This module does not implement sandboxing (envs/sandbox/) nor the budget loop (envs/base.py).
"""
from __future__ import annotations

import functools
import json
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping

from envs.base import Domain, EnvSetupError, ToolEnv, ToolInvocation, ToolOutput
from envs.cad.families import FAMILIES
from envs.cad.kernel.brep import BrepLimits
from envs.cad.kernel.runner import REPORT_MARKER
from envs.sandbox.base import ExecResult, Mount, Sandbox, SandboxBackend, SandboxLimits
from envs.tools import ToolArgError, ToolContext, tool
from jointrl.records import Message, Task
from rewards import Rubric, Term, check, malformed_fraction

KERNEL_DIR = Path(__file__).resolve().parent / "kernel"
INSIDE_ROOT = "/opt/jointrl-cad"
MAX_BREP_BYTES = BrepLimits().max_bytes
VIEW_PX = 128  # render_view's square side: a multiple of the policy's patch size (16 -> 64 patches)
# Waiting for a worker + grading; the work alone has the pool's shorter work timeout (worker.py).
GRADE_TIMEOUT_S = 90.0
KILL_MARGIN_S = 1.0
# cadquery + OCP + VTK map ~1.1 GB of address space before any modelling; booleans need more.
CAD_SANDBOX_LIMITS = SandboxLimits(workdir_mb=64, tmp_mb=64, max_procs=64, address_space_mb=3072,
                                   file_size_mb=32, cpu_seconds=120, open_files=512, max_output_bytes=200_000)
AGENT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb",
             "MPLCONFIGDIR": "/tmp", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True)
class SandboxPython:
    """How the sandbox gets a Python that can `import cadquery`: read-only mounts + the interpreter path inside."""

    mounts: tuple[Mount, ...]
    python: str  # path of the interpreter inside the sandbox
    runner: str  # path of kernel/runner.py inside the sandbox

    @staticmethod
    def from_current() -> "SandboxPython":
        """Mount this process's environment: the venv at /opt/jointrl-cad/venv and, when the venv's base
        interpreter is outside /usr (pyenv, conda), that installation at its own path so the venv's
        absolute symlinks resolve."""
        mounts = [Mount(KERNEL_DIR, f"{INSIDE_ROOT}/kernel")]
        prefix, base = Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()
        if prefix != base:  # a venv
            mounts.append(Mount(prefix, f"{INSIDE_ROOT}/venv"))
            python = f"{INSIDE_ROOT}/venv/bin/python"
            if not str(base).startswith("/usr/") and str(base) != "/usr":
                mounts.append(Mount(base, str(base)))
        elif str(prefix).startswith("/usr"):
            python = sys.executable
        else:
            mounts.append(Mount(prefix, str(prefix)))
            python = sys.executable
        return SandboxPython(tuple(mounts), python, f"{INSIDE_ROOT}/kernel/runner.py")


@functools.lru_cache(maxsize=1)
def default_backend() -> SandboxBackend:
    from envs.sandbox.bwrap import BwrapBackend

    return BwrapBackend()


@dataclass(frozen=True)
class RunOutcome:
    """One execution of agent code in the sandbox, as the host understood it."""

    ok: bool  # a valid solid was built (and exported, when asked)
    text: str  # what the agent is shown
    timed_out: bool = False
    out_rel: str | None = None  # the BREP file (relative to the work dir) when ok and exported


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def describe_run(r: ExecResult, timeout_s: float) -> tuple[bool, str]:
    """(ok, text for the agent) from the runner's ExecResult."""
    if r.timed_out:
        return False, f"ERROR: killed: your code did not finish within its {timeout_s:.0f} s time limit; nothing was built."
    report = None
    for line in reversed(r.stdout.split("\n")):  # not splitlines(): it splits at the marker's \x1e
        if line.startswith(REPORT_MARKER):
            try:
                report = json.loads(line[len(REPORT_MARKER):])
            except ValueError:
                report = None
            break
    if not isinstance(report, dict):
        why = f"killed by signal {-r.exit_code}" if r.exit_code < 0 else f"exit code {r.exit_code}"
        hint = " (probably the memory limit)" if r.exit_code in (-9, -6) else ""
        tail = (r.stderr or "")[-1500:]
        return False, f"ERROR: the CAD run ended without a report ({why}{hint}).\n{tail}".rstrip()
    # The report is whatever the sandboxed process printed (the agent's code can print its own): it
    # decides only what the agent is shown and whether a file is looked for, so it is read defensively.
    parts = []
    s = report.get("summary")
    if report.get("ok") is True and isinstance(s, dict):
        try:
            b = [float(x) for x in s["bbox"]][:6]
            parts.append("OK: `result` is a valid solid.\n"
                         f"volume: {_fmt(float(s['volume']))} mm^3\n"
                         f"bounding box: x [{_fmt(b[0])}, {_fmt(b[3])}]  y [{_fmt(b[1])}, {_fmt(b[4])}]  z [{_fmt(b[2])}, {_fmt(b[5])}]"
                         f"  (size {_fmt(b[3] - b[0])} x {_fmt(b[4] - b[1])} x {_fmt(b[5] - b[2])})\n"
                         f"faces: {int(s['faces'])} (same-surface faces merged)\n"
                         f"through-holes: {int(s['holes'])}\n"
                         f"solids: {int(s['solids'])}")
        except (KeyError, IndexError, TypeError, ValueError, OverflowError):
            parts.append("OK: `result` is a valid solid.")
    else:
        parts.append(f"ERROR: {str(report.get('error') or 'unknown failure')}".rstrip())
    out = report.get("stdout") or ""
    if isinstance(out, str) and out.strip():
        parts.append("--- output of your code ---\n" + out.rstrip())
    return report.get("ok") is True, "\n".join(parts)


class CadDomain(Domain):
    rubric = Rubric(terms=(Term("score", check("score"), 1.0), Term("malformed", malformed_fraction, -0.1)),
                    truncated_reward=0.0, error_reward=0.0)

    def __init__(self, backend: SandboxBackend | None = None, sandbox_limits: SandboxLimits = CAD_SANDBOX_LIMITS,
                 python: SandboxPython | None = None, pool=None, grade_timeout_s: float = GRADE_TIMEOUT_S,
                 families: Collection[str] = tuple(FAMILIES)) -> None:
        self.backend = backend if backend is not None else default_backend()
        self.sandbox_limits = sandbox_limits
        self.python = python if python is not None else SandboxPython.from_current()
        self._pool = pool
        self.grade_timeout_s = grade_timeout_s
        # The task families this domain sets up (a curriculum rung passes its own; envs/cad/primitive.py).
        self.families = frozenset(families)
        self.sandbox: Sandbox | None = None
        self.submission: RunOutcome | None = None
        self.current: RunOutcome | None = None  # the last run that built a valid solid (what render_view draws)

    @property
    def pool(self):
        if self._pool is None:
            from envs.cad.worker import default_pool

            self._pool = default_pool()
        return self._pool

    def setup(self, task: Task) -> None:
        family = task.private.get("family")
        if family not in self.families:
            raise EnvSetupError(f"task {task.id}: unknown CAD family {family!r}")
        if not isinstance(task.private.get("reference_code"), str):
            raise EnvSetupError(f"task {task.id}: private['reference_code'] is missing")
        self.teardown()
        self.submission = self.current = None
        self.sandbox = self.backend.open(limits=self.sandbox_limits, mounts=self.python.mounts)

    def _run(self, code: str, timeout_s: float, export: bool) -> RunOutcome:
        assert self.sandbox is not None, "CAD tool called outside an episode"
        rel = f".cad/{secrets.token_hex(8)}.brep" if export else None
        out_inside = f"{self.sandbox.workdir_inside}/{rel}" if rel else "-"
        # Kill a little before the framework's deadline: the sandbox needs up to ~2 s to drain after a
        # kill, and the framework stops waiting at timeout + grace; this way the tool itself reports
        # the kill (and a killed submit still ends the episode).
        run_s = max(1.0, timeout_s - KILL_MARGIN_S)
        r = self.sandbox.run([self.python.python, "-I", self.python.runner, out_inside], stdin=code.encode(),
                             timeout_s=run_s, env=AGENT_ENV, cwd=self.sandbox.workdir_inside)
        ok, text = describe_run(r, run_s)
        return RunOutcome(ok=ok, text=text, timed_out=r.timed_out, out_rel=rel if ok else None)

    @tool
    def run_cad(self, code: str, ctx: ToolContext) -> ToolOutput:
        """Run CadQuery code and report on the solid it builds (or the error). Does not end the episode.

        The code must assign the finished part to `result`. The report gives the solid's volume, bounding box,
        face count and through-hole count, plus anything the code printed.

        Args:
            code: Python code using cadquery (available as `cq`) that assigns the part to `result`
        """
        out = self._run(code, ctx.timeout_s, export=True)
        if out.ok:
            self.current = out
        return ToolOutput(out.text, timed_out=out.timed_out)

    @tool
    def render_view(self, view: str, ctx: ToolContext) -> ToolOutput:
        """Render one view of your current solid (the last one run_cad built) as an image, to compare with the target.

        Args:
            view: which view: "top" (looking down -Z), "front" (from -Y), "right" (from +X) or "iso" (from (+1, -1, +1))
        """
        from envs.cad.render import VIEW_NAMES

        if view not in VIEW_NAMES:
            raise ToolArgError(f"view must be one of {', '.join(VIEW_NAMES)}; got {view!r}")
        cur = self.current
        if cur is None or cur.out_rel is None or self.sandbox is None:
            return ToolOutput("ERROR: no solid yet: build one with run_cad first.")
        try:
            data = self.sandbox.read_artifact(cur.out_rel, max_bytes=MAX_BREP_BYTES)
            png = self.pool.render_submission(data, view, VIEW_PX, timeout_s=max(1.0, ctx.timeout_s - KILL_MARGIN_S))
        except ValueError as e:
            return ToolOutput(f"ERROR: the current solid cannot be drawn: {e}")
        except OSError:
            return ToolOutput("ERROR: the current solid's file is gone or unreadable; run run_cad again.")
        return ToolOutput(f"The {view} view of your current solid ({VIEW_PX}x{VIEW_PX} pixels).", images=(png,))

    @tool(ends_episode=True)
    def submit(self, code: str, ctx: ToolContext) -> ToolOutput:
        """Run your final CadQuery code and submit the solid it builds for grading. Ends the episode.

        Args:
            code: Python code using cadquery (available as `cq`) that assigns the finished part to `result`
        """
        out = self._run(code, ctx.timeout_s, export=True)
        self.submission = out
        head = "Submitted." if out.ok else "Submitted, but the code did not produce a valid solid (this scores 0)."
        return ToolOutput(f"{head}\n{out.text}", timed_out=out.timed_out)

    def before_grade(self) -> None:
        if self.sandbox is not None:
            self.sandbox.kill_all()

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        zero = {"score": 0.0, "iou": 0.0, "holes_ok": 0.0, "faces_ok": 0.0, "bbox_ok": 0.0, "feature_term": 0.0}
        sub = self.submission
        if sub is None:
            return {**zero, "submitted": 0.0, "valid": 0.0, "code_failed": 0.0, "timed_out": 0.0}
        if not sub.ok or sub.out_rel is None:
            return {**zero, "submitted": 1.0, "valid": 0.0, "code_failed": 1.0, "timed_out": float(sub.timed_out)}
        if self.sandbox is None:
            raise RuntimeError("check() without a sandbox (set-up failed or the env was closed)")
        try:
            data = self.sandbox.read_artifact(sub.out_rel, max_bytes=MAX_BREP_BYTES)
        except Exception:  # noqa: BLE001 - missing, a symlink, not regular or too big: no valid solid was left
            return {**zero, "submitted": 1.0, "valid": 0.0, "code_failed": 0.0, "timed_out": 0.0, "brep_unreadable": 1.0}
        res = self.pool.grade(task.private["reference_code"], data, timeout_s=self.grade_timeout_s)
        if not res.valid or res.comparison is None:
            return {**zero, "submitted": 1.0, "valid": 0.0, "code_failed": 0.0, "timed_out": 0.0,
                    f"reject_{res.code or 'no_solid'}": 1.0}
        c = res.comparison
        return {"score": c.score, "iou": c.iou, "holes_ok": c.holes_ok, "faces_ok": c.faces_ok, "bbox_ok": c.bbox_ok,
                "feature_term": c.feature_term, "submitted": 1.0, "valid": 1.0, "code_failed": 0.0, "timed_out": 0.0,
                "volume_ratio": c.v_agent / c.v_ref, "bbox_err_mm": c.bbox_err_mm,
                "holes": float(c.agent_holes), "ref_holes": float(c.ref_holes),
                "faces": float(c.agent_faces), "ref_faces": float(c.ref_faces),
                "solids": float(c.agent_solids), "voids": float(c.agent_voids)}

    def teardown(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            sb.close()

    def reference(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("submit", {"code": task.private["reference_code"]})]

    def noop(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("submit", {"code": ""})]


class CadEnv(ToolEnv):
    """`ToolEnv` over a CAD domain; `prompt_views`: attach the target's views to the user message at `reset`."""

    def __init__(self, domain: Domain, *, prompt_views: bool = False, **kwargs) -> None:
        super().__init__(domain, **kwargs)
        self.prompt_views = prompt_views

    async def reset(self, task: Task):
        if self.prompt_views:
            task = with_prompt_views(task)
        return await super().reset(task)


def with_prompt_views(task: Task) -> Task:
    """`task` with the target's views (`tasks.prompt_image`) as the images of its last user message (replacing any:
    a task row round trip drops them, and resetting twice must not add them twice)."""
    import dataclasses

    from envs.cad.tasks import prompt_image

    users = [i for i, m in enumerate(task.prompt) if m.role == "user"]
    if not users:
        raise EnvSetupError(f"task {task.id}: no user message to attach the target's views to")
    try:
        png = prompt_image(task.public)
    except ValueError as e:
        raise EnvSetupError(f"task {task.id}: {e}") from None
    prompt = list(task.prompt)
    prompt[users[-1]] = dataclasses.replace(prompt[users[-1]], images=(png,))
    return dataclasses.replace(task, prompt=tuple(prompt))
