"""terminal-v0: the agent gets a sandboxed shell (`bash`) and a `submit` tool; the grader checks the final state.

Per episode: a fresh sandbox from the backend (bubblewrap by default: no network, read-only
root, a size-limited work dir, rlimits, a wall-clock kill), the task's files written into its work
dir, and the task's trusted set-up commands run (e.g. building a git history). Every `bash` call
runs with a fixed environment and the tool's time limit; the sandbox kills what overruns.
Grading happens after `kill_all()`: the family's check reads the agent's files as data or runs
trusted programs in a fresh sandbox (see grader.py). The rubric: `correct` (0/1) minus 0.1 x the
fraction of malformed calls; truncated or errored episodes score 0.

This module does not implement sandboxing (envs/sandbox/) nor the budget loop (envs/base.py).
"""
from __future__ import annotations

import base64
import functools
from typing import Any, Mapping

from envs.base import Domain, EnvSetupError, ToolInvocation, ToolOutput
from envs.sandbox.base import Sandbox, SandboxBackend, SandboxLimits
from envs.terminal.basics import BASIC_FAMILIES
from envs.terminal.families import FAMILIES
from envs.terminal.grader import Grader
from envs.tools import ToolContext, tool
from jointrl.records import Message, Task
from rewards import Rubric, Term, check, malformed_fraction

# The agent's commands see exactly this environment (the sandbox clears the host's). An explicit
# PATH matters: with PATH unset, bash falls back to a built-in search path that may include ".".
AGENT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb"}
SETUP_TIMEOUT_S = 30.0
ALL_FAMILIES = {**FAMILIES, **BASIC_FAMILIES}  # terminal-v0 and terminal-basics-v0 share this domain
assert len(ALL_FAMILIES) == len(FAMILIES) + len(BASIC_FAMILIES), "family names must be unique across terminal env ids"


@functools.lru_cache(maxsize=1)
def default_backend() -> SandboxBackend:
    """The bubblewrap backend, shared by the process. Raises SandboxUnavailable when the host refuses it."""
    from envs.sandbox.bwrap import BwrapBackend

    return BwrapBackend()


def decode_files(public: Mapping[str, Any]) -> list[tuple[str, bytes, int]]:
    """Task.public["files"] -> (relative path, bytes, mode). Text is stored as text, binary as base64."""
    out = []
    for f in public.get("files", ()):
        data = f["text"].encode() if "text" in f else base64.b64decode(f["b64"])
        out.append((f["path"], data, int(f.get("mode", 0o644))))
    return out


class TerminalDomain(Domain):
    rubric = Rubric(terms=(Term("correct", check("correct"), 1.0), Term("malformed", malformed_fraction, -0.1)),
                    truncated_reward=0.0, error_reward=0.0)

    def __init__(self, backend: SandboxBackend | None = None, sandbox_limits: SandboxLimits = SandboxLimits()) -> None:
        self.backend = backend if backend is not None else default_backend()
        self.sandbox_limits = sandbox_limits
        self.sandbox: Sandbox | None = None

    def setup(self, task: Task) -> None:
        family = task.private.get("family")
        if family not in ALL_FAMILIES:
            raise EnvSetupError(f"task {task.id}: unknown terminal family {family!r}")
        self.teardown()
        self.sandbox = self.backend.open(limits=self.sandbox_limits)
        for path, data, mode in decode_files(task.public):
            self.sandbox.write_file(path, data, mode)
        for cmd in task.public.get("setup", ()):
            r = self.sandbox.run(cmd, timeout_s=SETUP_TIMEOUT_S, env=AGENT_ENV, cwd=self.sandbox.workdir_inside)
            if r.exit_code != 0 or r.timed_out:
                raise EnvSetupError(f"task {task.id}: set-up command failed (exit {r.exit_code}): {cmd!r}\n{r.stderr[-2000:]}")

    @tool
    def bash(self, command: str, ctx: ToolContext) -> ToolOutput:
        """Run a bash command in the task's working directory and return its output.

        Each call starts a new shell in the same directory (files persist; `cd`, variables and
        background processes do not). There is no network access.

        Args:
            command: the bash command line to run
        """
        assert self.sandbox is not None, "bash() outside an episode"
        r = self.sandbox.run(command, timeout_s=ctx.timeout_s, env=AGENT_ENV, cwd=self.sandbox.workdir_inside)
        parts = [r.stdout]
        if r.stderr:
            parts.append(("\n" if r.stdout and not r.stdout.endswith("\n") else "") + "[stderr]\n" + r.stderr)
        if r.output_truncated:
            parts.append("\n[output truncated by the sandbox]")
        if r.timed_out:
            parts.append(f"\n[killed: the command exceeded its {ctx.timeout_s:.1f} s time limit]")
        else:
            parts.append(f"\n[exit code: {r.exit_code}]")
        return ToolOutput("".join(parts).lstrip("\n"), timed_out=r.timed_out)

    @tool(ends_episode=True)
    def submit(self) -> str:
        """Finish the task. Call this once the files are in their final state; the state is then graded."""
        return "Submitted."

    def before_grade(self) -> None:
        if self.sandbox is not None:
            self.sandbox.kill_all()

    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        if self.sandbox is None:
            raise RuntimeError("check() without a sandbox (set-up failed or the env was closed)")
        family = ALL_FAMILIES[task.private["family"]]
        score = family.check(Grader(self.sandbox, self.backend, self.sandbox_limits), task.private["check"])
        return {"correct": float(score)}

    def teardown(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            sb.close()

    def reference(self, task: Task) -> list[ToolInvocation]:
        return [ToolInvocation("bash", {"command": c}) for c in task.private["reference"]] + [ToolInvocation("submit")]
