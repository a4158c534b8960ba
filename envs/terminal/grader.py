"""Trusted read access to what the agent left, for the terminal families' final-state checks.

Rules (issue 6, "Grading"): the grader runs only after every agent process is gone
(`Sandbox.kill_all`); it reads agent files as *data* through `read_artifact` (no symlinks,
regular files only, size caps); anything that needs a program (git, the agent's own script) runs
in a *fresh* sandbox on the pristine read-only root, with the agent's files copied in as data and
trusted inputs added by the grader. Programs are called by absolute path with an explicit
environment, so nothing the agent placed in its work dir (a fake `python3`, a `.bashrc`) is run
in their place. A file the agent did not produce, or produced as a symlink, is simply missing
(the check fails, score 0); it is not a grading error.

Metadata (file type, permission bits) comes from `Sandbox.stat_artifact`, a host-side lstat
that never follows a link: nothing runs in the agent's sandbox after `kill_all`, so no program the
agent planted or replaced (a fake `find`, `stat`) is ever consulted.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from envs.sandbox.base import ExecResult, PathStat, Sandbox, SandboxBackend, SandboxLimits
from envs.sandbox.safefs import ArtifactError

TRUSTED_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1"}


class Grader:
    def __init__(self, sandbox: Sandbox, backend: SandboxBackend, limits: SandboxLimits) -> None:
        self.sandbox = sandbox
        self.backend = backend
        self.limits = limits

    def read(self, path: str, max_bytes: int = 1_000_000) -> bytes | None:
        """The bytes of an agent file, or None if it is missing, a symlink, not regular, or too big."""
        try:
            return self.sandbox.read_artifact(path, max_bytes=max_bytes)
        except Exception:  # noqa: BLE001 - every refusal means "the agent did not produce a valid file"
            return None

    def read_text(self, path: str, max_bytes: int = 1_000_000) -> str | None:
        data = self.read(path, max_bytes)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def files(self) -> list[str]:
        """The agent's regular files, or [] when the work dir is one the sandbox refuses to list (more
        files than its cap): a degenerate work dir is the agent's failure, not a grading error."""
        try:
            return self.sandbox.list_artifacts()
        except ArtifactError:
            return []

    def stat(self, path: str) -> PathStat | None:
        """Type and permission bits of an agent entry (not followed), or None if missing or refused
        (a symlinked parent directory, a path outside the work dir)."""
        try:
            return self.sandbox.stat_artifact(path)
        except (FileNotFoundError, ArtifactError):
            return None

    def run_fresh(self, files: Mapping[str, bytes], commands: Sequence[list[str]], *,
                  timeout_s: float = 20.0, stdin: bytes | None = None) -> list[ExecResult]:
        """Run trusted argv commands in a fresh grading sandbox holding `files`; it is closed after.

        `files` are data the grader chose (the agent's script read with `read`, hidden inputs); the
        sandbox is a pristine one with nothing of the agent's beyond them (`agent=None`).
        """
        sb = self.backend.open_pristine(agent=None, files=dict(files), limits=self.limits)
        try:
            return [sb.run(cmd, timeout_s=timeout_s, env=TRUSTED_ENV, cwd=sb.workdir_inside, stdin=stdin)
                    for cmd in commands]
        finally:
            sb.close()
