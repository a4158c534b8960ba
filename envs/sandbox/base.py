"""The sandbox interface every backend implements (bubblewrap here; a container or remote backend on clusters).

A `SandboxBackend` opens one `Sandbox` per episode. The sandbox owns a persistent, size-limited
work directory that survives across `run` calls within the episode; every `run` executes inside
fresh namespaces with no network, read-only root, rlimits and a wall-clock kill. `close()` kills
every process of the episode and removes the work dir; it is idempotent.

Trusted code (graders) reads what the agent left with `read_artifact` / `list_artifacts` /
`stat_artifact`, which refuse symlinks (anywhere on the path) and non-regular files and cap sizes:
the agent's files are data, never code the host runs. Anything that needs a program runs in a
sandbox from `SandboxBackend.open_pristine`: a fresh root the agent never touched, with the agent's
regular files copied in as read-only data. This module holds only the interface and the records;
see `bwrap.py` for the backend and `tests/envs/fakes.py` for an unsandboxed test double.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


class SandboxUnavailable(RuntimeError):
    """The kernel or host refuses what the sandbox needs; we never fall back to running unsandboxed."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox resource limits (the agent cannot change them)."""

    workdir_mb: int = 64  # size of the writable work dir (tmpfs)
    tmp_mb: int = 64  # private /tmp
    max_procs: int = 64  # processes/threads for the sandbox uid
    address_space_mb: int = 2048  # RLIMIT_AS per process
    file_size_mb: int = 32  # RLIMIT_FSIZE
    cpu_seconds: int = 30  # RLIMIT_CPU per process
    open_files: int = 256
    max_output_bytes: int = 1_000_000  # stdout/stderr captured per command (rest dropped, flagged)


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int  # -signal if killed by a signal
    timed_out: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0


@dataclass(frozen=True)
class Mount:
    """A read-only host path made visible inside the sandbox (e.g. a cached library, the CAD venv)."""

    host: Path
    inside: str


@dataclass(frozen=True)
class PathStat:
    """One work-dir entry as `Sandbox.stat_artifact` sees it: the entry itself (a symlink is reported
    as a symlink, never followed)."""

    kind: str  # "file", "dir", "symlink", "fifo", "socket", "char", "block"
    mode: int  # permission bits only (e.g. 0o755): no file-type or setuid bits
    size: int  # bytes (st_size of the entry itself)
    uid: int  # owner on the host


@dataclass(frozen=True)
class CopyReport:
    """What `open_pristine` copied from the agent's work dir, and what it left out and why (a link, a cap)."""

    copied: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]  # (relative path or "*", reason)


class Sandbox(abc.ABC):
    workdir_inside: str = "/work"
    # Set on sandboxes from `SandboxBackend.open_pristine(agent=<a Sandbox>)`: which agent files
    # reached `agent_dir`. None on episode sandboxes and when the agent was a mapping or None.
    agent_copy: CopyReport | None = None

    @abc.abstractmethod
    def run(self, command: str | list[str], *, timeout_s: float, stdin: bytes | None = None,
            env: Mapping[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        """Run a command (a str goes to `bash -c`) in the sandbox; never raises for what the command does."""

    @abc.abstractmethod
    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Trusted set-up: place a file in the work dir (path relative to it)."""

    @abc.abstractmethod
    def read_artifact(self, path: str, max_bytes: int = 1_000_000) -> bytes:
        """Read an agent-written file as data: O_NOFOLLOW, regular files only, size-capped; raises on violation."""

    @abc.abstractmethod
    def list_artifacts(self, max_files: int = 10_000) -> list[str]:
        """Relative paths of regular files in the work dir (symlinks not followed)."""

    @abc.abstractmethod
    def stat_artifact(self, path: str) -> PathStat:
        """Type, permission bits, size and owner of a work-dir entry, without following it.

        For graders that check metadata (`chmod` tasks), so they never run a program in the agent's
        sandbox. `path` is relative to the work dir (or absolute under `workdir_inside`). The last
        component is lstat'ed (a symlink comes back as kind "symlink"); a symlink among the parent
        directories, `..` or a path outside the work dir raises `ArtifactError`; a missing entry
        raises `FileNotFoundError`. Call it after `kill_all`: it does not stop a running agent
        from changing the entry afterwards.
        """

    @abc.abstractmethod
    def kill_all(self) -> None:
        """Kill every process the sandbox started (grading must start only after this)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill everything and delete the work dir. Idempotent."""


class SandboxBackend(abc.ABC):
    @abc.abstractmethod
    def open(self, *, limits: SandboxLimits = SandboxLimits(), files: Mapping[str, bytes] | None = None,
             mounts: tuple[Mount, ...] = (), network: bool = False) -> Sandbox:
        """Open a fresh sandbox with `files` (relative path -> bytes) in its work dir."""

    @abc.abstractmethod
    def open_pristine(self, *, agent: Sandbox | Mapping[str, bytes] | None, files: Mapping[str, bytes] | None = None,
                      limits: SandboxLimits = SandboxLimits(), mounts: tuple[Mount, ...] = (),
                      agent_dir: str = "/agent", max_agent_files: int = 10_000,
                      max_agent_file_bytes: int = 32 * 1024 * 1024) -> Sandbox:
        """A fresh sandbox for trusted checks, with the agent's files as read-only data at `agent_dir`.

        `agent` is the episode's sandbox (the backend calls its `kill_all` first, then copies its
        regular files only: symlinks and special files are skipped, files over
        `max_agent_file_bytes` or past `max_agent_files` are left out rather than raising, and
        the result is recorded in the returned sandbox's `agent_copy`), or a mapping of relative
        path -> bytes written there as they are, or None (nothing at `agent_dir`). `files` (the
        grader's tests, references) go into the work dir, written by trusted code. The root must be
        one the agent never wrote to, so a `python3`/`pytest` the agent planted can never run in
        place of the real one; commands get the clean default PATH. The agent's sandbox stays
        usable for `read_artifact` / `stat_artifact` / `list_artifacts` until it is closed.
        Never put `agent_dir` on PYTHONPATH wholesale (a planted sitecustomize.py would run).
        """
