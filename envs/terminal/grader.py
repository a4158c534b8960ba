"""Trusted read access to what the agent left, for the terminal families' final-state checks.

Rules (issue 6, "Grading"): the grader runs only after every agent process is gone
(`Sandbox.kill_all`); it reads agent files as *data* through `read_artifact` (no symlinks,
regular files only, size caps); anything that needs a program (git, the agent's own script) runs
in a *fresh* sandbox on the pristine read-only root, with the agent's files copied in as data and
trusted inputs added by the grader. Programs are called by absolute path with an explicit
environment, so nothing the agent placed in its work dir (a fake `python3`, a `.bashrc`) is run
in their place. A file the agent did not produce, or produced as a symlink, is simply missing
(the check fails, score 0); it is not a grading error.

The one check that reads metadata in the agent's own sandbox is `modes()` (file permission
bits): `read_artifact` returns bytes only, and the interface has no stat. It runs
`/usr/bin/find -printf` from the read-only root after `kill_all`, with no shell, and parses the
output as data. (A `stat_artifact` in the sandbox interface would remove this exception.)
"""
from __future__ import annotations

from typing import Mapping, Sequence

from envs.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxLimits

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
        return self.sandbox.list_artifacts()

    def modes(self, under: str = ".") -> dict[str, tuple[str, int]]:
        """Relative path -> (type letter from find's %y, permission bits) for everything under `under`."""
        r = self.sandbox.run(["/usr/bin/find", under, "-mindepth", "1", "-printf", "%P\\t%y\\t%m\\n"],
                             timeout_s=20.0, env=TRUSTED_ENV, cwd=self.sandbox.workdir_inside)
        out: dict[str, tuple[str, int]] = {}
        if r.exit_code != 0:
            return out
        for line in r.stdout.splitlines():
            parts = line.split("\t")
            if len(parts) == 3:
                out[parts[0]] = (parts[1], int(parts[2], 8))
        return out

    def run_fresh(self, files: Mapping[str, bytes], commands: Sequence[list[str]], *,
                  timeout_s: float = 20.0, stdin: bytes | None = None) -> list[ExecResult]:
        """Run trusted argv commands in a fresh sandbox holding `files`; the sandbox is closed after."""
        sb = self.backend.open(limits=self.limits, files=dict(files))
        try:
            return [sb.run(cmd, timeout_s=timeout_s, env=TRUSTED_ENV, cwd=sb.workdir_inside, stdin=stdin)
                    for cmd in commands]
        finally:
            sb.close()
