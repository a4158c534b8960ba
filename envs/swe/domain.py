"""swe-v0: fix an injected bug in a real Python library; graded by the full suite, hidden tests included.

Per episode: a fresh sandbox (bubblewrap by default) holding the library's repository at the
work dir: the pinned sdist with the bug injected and the FAIL_TO_PASS test functions removed,
made a git repository with one commit (no history, tags, reflog or remotes: nothing that holds
the fix). The pytest runtime and the interpreter are read-only mounts; the agent's shell has
`python` / `pytest` on PATH.

Tools: `bash`, `view(path, line_range)`, `str_replace(path, old, new)`, `run_tests(selector)`
(visible tests only: the hidden ones are not in the sandbox) and `submit()`.

Grading (grader.py): only the agent's edits to library files are applied to a clean tree with the
original tests, once editcheck.py has accepted them, and only as function bodies spliced into the
starting files (no import-time code of the agent's runs); the suite runs in a fresh pristine
sandbox. Both sandboxes see only the allowlisted host files of mounts.py. Reward: `resolved` (every
FAIL_TO_PASS and PASS_TO_PASS test passes) minus 0.1 x the malformed-call fraction; the
FAIL_TO_PASS fraction and PASS_TO_PASS breakage are metrics. Truncated or errored episodes score 0.

This module does not build instances (build.py) nor enforce budgets (envs/base.py).
"""
from __future__ import annotations

import functools
import shlex
from typing import Mapping

from envs.base import Domain, EnvSetupError, ToolInvocation, ToolOutput
from envs.sandbox.base import Sandbox, SandboxBackend, SandboxLimits
from envs.swe import grader as G
from envs.swe import instances as I
from envs.swe import libraries as L
from envs.swe import mounts as M
from envs.swe.runner import TEST_ENV, driver_argv
from envs.tools import ToolArgError, ToolContext, tool
from jointrl.records import Message, Task
from rewards import Rubric, Term, check, malformed_fraction

AGENT_LIMITS = SandboxLimits(workdir_mb=64, tmp_mb=64, max_procs=64, address_space_mb=2048, file_size_mb=32,
                             cpu_seconds=60, open_files=256, max_output_bytes=1_000_000)
SETUP_TIMEOUT_S = 60.0
# A fixed identity and date: the single commit's hash is the same in every episode of an instance.
GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "jointrl", "GIT_AUTHOR_EMAIL": "swe@jointrl.invalid",
           "GIT_COMMITTER_NAME": "jointrl", "GIT_COMMITTER_EMAIL": "swe@jointrl.invalid",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00"}
# One commit; then drop what could hold anything else: the reflog, hook samples, the commit message file.
GIT_SETUP = ("git -c init.defaultBranch=main init -q && git add -A && git commit -q -m 'Initial commit' "
             "&& rm -rf .git/logs .git/hooks .git/COMMIT_EDITMSG .git/description")
VIEW_MAX_LINES = 400


@functools.lru_cache(maxsize=1)
def default_backend() -> SandboxBackend:
    from envs.sandbox.bwrap import BwrapBackend

    return BwrapBackend()


class SweDomain(Domain):
    rubric = Rubric(terms=(Term("resolved", check("resolved"), 1.0), Term("malformed", malformed_fraction, -0.1)),
                    truncated_reward=0.0, error_reward=0.0)

    def __init__(self, backend: SandboxBackend | None = None, sandbox_limits: SandboxLimits = AGENT_LIMITS,
                 grade_limits: SandboxLimits = G.GRADE_LIMITS) -> None:
        self.backend = backend if backend is not None else default_backend()
        self.sandbox_limits = sandbox_limits
        self.grade_limits = grade_limits
        self.sandbox: Sandbox | None = None
        self.lib: L.Library | None = None
        self.start: dict[str, bytes] = {}

    # ------------------------------------------------------------------ episode lifecycle
    def setup(self, task: Task) -> None:
        self.teardown()
        try:
            self.lib = I.task_library(task)
            self.start = I.agent_repo(task)
            M.test_mounts()  # the runtime is assembled here, so a failure is a set-up error
        except Exception as e:  # noqa: BLE001 - a missing cache / bad task cannot start an episode
            raise EnvSetupError(f"task {task.id}: cannot prepare the repository: {type(e).__name__}: {e}") from e
        self.sandbox = M.open_sandbox(self.backend, limits=self.sandbox_limits, files=self.start)
        r = self.sandbox.run(GIT_SETUP, timeout_s=SETUP_TIMEOUT_S, env=GIT_ENV, cwd=self.sandbox.workdir_inside)
        if r.exit_code != 0 or r.timed_out:
            raise EnvSetupError(f"task {task.id}: git set-up failed (exit {r.exit_code}): {r.stderr[-2000:]}")

    def _agent_env(self) -> dict[str, str]:
        assert self.lib is not None and self.sandbox is not None
        root = self.sandbox.workdir_inside + (f"/{self.lib.import_root}" if self.lib.import_root else "")
        return {"PATH": f"{G.RUNTIME_INSIDE}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
                "TERM": "dumb", "PYTHONPATH": f"{root}:{G.RUNTIME_INSIDE}/site", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONHASHSEED": "0"}

    def _sb(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("no episode is running")
        return self.sandbox

    # ------------------------------------------------------------------ tools
    @tool
    def bash(self, command: str, ctx: ToolContext) -> ToolOutput:
        """Run a bash command in the repository (the working directory) and return its output.

        Each call starts a new shell in the repository root (files persist; `cd`, variables and
        background processes do not). `python` and `pytest` are on PATH; there is no network.

        Args:
            command: the bash command line to run
        """
        sb = self._sb()
        r = sb.run(command, timeout_s=ctx.timeout_s, env=self._agent_env(), cwd=sb.workdir_inside)
        return ToolOutput(_render(r, ctx.timeout_s), timed_out=r.timed_out)

    @tool
    def view(self, path: str, line_range: list[int] | None = None) -> str:
        """Show a file with line numbers, or list a directory.

        Args:
            path: file or directory, relative to the repository root
            line_range: optional [first, last] line numbers (1-based, inclusive; last = -1 means end of file)
        """
        sb = self._sb()
        rel = _relpath(path)
        if line_range is not None and (len(line_range) != 2 or line_range[0] < 1
                                       or (line_range[1] != -1 and line_range[1] < line_range[0])):
            raise ToolArgError("line_range must be [first, last] with 1 <= first <= last, or last = -1")
        try:
            data = sb.read_artifact(rel or ".", max_bytes=4 << 20) if rel else None
        except Exception:  # noqa: BLE001 - not a regular file: maybe a directory
            data = None
        if data is None:
            prefix = rel + "/" if rel else ""
            entries = sorted({p[len(prefix):].split("/")[0] + ("/" if "/" in p[len(prefix):] else "")
                              for p in sb.list_artifacts() if p.startswith(prefix) and not p.startswith(".git/")})
            if not entries:
                return f"Error: {path!r} is not a file or directory in the repository (symlinks are not followed)"
            return "\n".join(entries)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return f"Error: {path!r} is not UTF-8 text ({len(data)} bytes)"
        lines = text.splitlines()
        first, last = (1, len(lines)) if line_range is None else (line_range[0], len(lines) if line_range[1] == -1 else line_range[1])
        last = min(last, len(lines))
        note = ""
        if line_range is None and last - first + 1 > VIEW_MAX_LINES:
            last = first + VIEW_MAX_LINES - 1
            note = f"\n[showing lines 1-{last} of {len(lines)}; pass line_range to see more]"
        if first > len(lines):
            return f"Error: {path!r} has {len(lines)} lines"
        return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(first, last + 1)) + note

    @tool
    def str_replace(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of `old` in a file with `new` (exact text, whitespace included).

        Args:
            path: file relative to the repository root
            old: the exact text to replace; it must occur exactly once in the file
            new: the replacement text
        """
        sb = self._sb()
        rel = _relpath(path)
        if not old:
            raise ToolArgError("old must not be empty")
        try:
            text = sb.read_artifact(rel, max_bytes=4 << 20).decode("utf-8")
        except UnicodeDecodeError:
            return f"Error: {path!r} is not UTF-8 text"
        except Exception as e:  # noqa: BLE001 - missing, a directory, a symlink
            return f"Error: cannot read {path!r}: {e}"
        count = text.count(old)
        if count != 1:
            return (f"Error: `old` occurs {count} times in {path}; " +
                    ("it must match the file exactly (whitespace included)." if count == 0 else
                     "include more surrounding lines so that it is unique."))
        new_text = text.replace(old, new, 1)
        try:
            sb.write_file(rel, new_text.encode("utf-8"))
        except Exception as e:  # noqa: BLE001 - e.g. the agent replaced the path by a symlink
            return f"Error: cannot write {path!r}: {e}"
        at = text.index(old)
        line = text.count("\n", 0, at) + 1
        shown = new_text.splitlines()[max(0, line - 3): line + new.count("\n") + 2]
        return f"Edited {path}. Lines {max(1, line - 2)}-:\n" + "\n".join(
            f"{max(1, line - 2) + i:6d}\t{ln}" for i, ln in enumerate(shown))

    @tool
    def run_tests(self, ctx: ToolContext, selector: str = "") -> ToolOutput:
        """Run the repository's visible tests with pytest and return the report.

        Args:
            selector: optional space-separated test paths or node ids (e.g. `tests/test_x.py::test_y`); empty runs all
        """
        sb = self._sb()
        assert self.lib is not None
        try:
            sels = shlex.split(selector)
            argv = driver_argv(self.lib, python=str(L.interpreter()), runtime=G.RUNTIME_INSIDE,
                               repo=sb.workdir_inside, out=None, selectors=sels)
        except ValueError as e:
            raise ToolArgError(f"selector: {e}") from None
        r = sb.run(argv, timeout_s=ctx.timeout_s, env=TEST_ENV, cwd=sb.workdir_inside)
        return ToolOutput(_render(r, ctx.timeout_s), timed_out=r.timed_out)

    @tool(ends_episode=True)
    def submit(self) -> str:
        """Finish: your changes to the library are then graded with the full test suite."""
        return "Submitted."

    # ------------------------------------------------------------------ grading
    def before_grade(self) -> None:
        if self.sandbox is not None:
            self.sandbox.kill_all()

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        if self.sandbox is None or self.lib is None:
            raise RuntimeError("check() without a sandbox (set-up failed or the env was closed)")
        edits = G.collect_edits(self.lib, self.start, self.sandbox)
        tree = I.grading_tree(task, edits.library_files)
        return G.grade(self.backend, self.lib, self.start, edits, tree, task.private["fail_to_pass"],
                       task.private["pass_to_pass"], limits=self.grade_limits).checks()

    def teardown(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            sb.close()

    def reference(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("str_replace", I.reference_edit(task)), ToolInvocation("submit")]


def _relpath(path: str) -> str:
    p = path.strip()
    for pre in ("/work/", "./"):
        if p.startswith(pre):
            p = p[len(pre):]
    if p in ("/work", ".", ""):
        return ""
    if p.startswith("/") or ".." in p.split("/"):
        raise ToolArgError(f"path {path!r} must be relative to the repository root (no '..')")
    return p.rstrip("/")


def _render(r, timeout_s: float) -> str:
    parts = [r.stdout]
    if r.stderr:
        parts.append(("\n" if r.stdout and not r.stdout.endswith("\n") else "") + "[stderr]\n" + r.stderr)
    if r.output_truncated:
        parts.append("\n[output truncated by the sandbox]")
    parts.append(f"\n[killed: the command exceeded its {timeout_s:.1f} s time limit]" if r.timed_out
                 else f"\n[exit code: {r.exit_code}]")
    return "".join(parts).lstrip("\n")
