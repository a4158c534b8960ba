"""The sandbox interface every backend implements (bubblewrap here; a container or remote backend on clusters).

A `SandboxBackend` opens one `Sandbox` per episode. The sandbox owns a persistent, size-limited
work directory that survives across `run` calls within the episode; every `run` executes inside
fresh namespaces with no network, read-only root, rlimits and a wall-clock kill. `close()` kills
every process of the episode and removes the work dir; it is idempotent.

Trusted code (graders) reads what the agent left with `read_artifact` / `list_artifacts`, which
refuse symlinks and non-regular files and cap sizes: the agent's files are data, never code the
host runs. This module holds only the interface and the records; see `bwrap.py` for the backend.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
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


class Sandbox(abc.ABC):
    workdir_inside: str = "/work"

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
