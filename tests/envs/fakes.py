"""Test doubles. `LocalBackend` implements the SandboxBackend interface with plain subprocesses in a temp
dir: it is NOT a sandbox and exists only so framework tests (budgets, malformed output, registry) do not
depend on bubblewrap. Terminal-domain tests that claim anything about isolation use the real backend.
"""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Mapping

from envs.sandbox.base import ExecResult, Mount, Sandbox, SandboxBackend, SandboxLimits


class LocalSandbox(Sandbox):
    def __init__(self, limits: SandboxLimits) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="jointrl-fake-"))
        self.workdir_inside = str(self.root)
        self.limits = limits
        self.closed = False
        self.kills = 0

    def run(self, command, *, timeout_s, stdin=None, env=None, cwd=None) -> ExecResult:
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        t0 = time.monotonic()
        p = subprocess.Popen(argv, cwd=cwd or self.root, env=dict(env or {"PATH": "/usr/bin:/bin"}),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = p.communicate(stdin, timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            timed_out = True
        cap = self.limits.max_output_bytes
        return ExecResult(stdout=out[:cap].decode("utf-8", "replace"), stderr=err[:cap].decode("utf-8", "replace"),
                          exit_code=p.returncode, timed_out=timed_out, output_truncated=len(out) > cap or len(err) > cap,
                          duration_s=time.monotonic() - t0)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        p = self.root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)

    def read_artifact(self, path: str, max_bytes: int = 1_000_000) -> bytes:
        fd = os.open(self.root / path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path}: not a regular file")
            data = os.read(fd, max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > max_bytes:
            raise OSError(f"{path}: larger than {max_bytes} bytes")
        return data

    def list_artifacts(self, max_files: int = 10_000) -> list[str]:
        out = []
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                p = Path(dirpath) / f
                if p.is_file() and not p.is_symlink():
                    out.append(str(p.relative_to(self.root)))
        return sorted(out)[:max_files]

    def kill_all(self) -> None:
        self.kills += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            shutil.rmtree(self.root, ignore_errors=True)


class LocalBackend(SandboxBackend):
    def __init__(self) -> None:
        self.opened: list[LocalSandbox] = []

    def open(self, *, limits: SandboxLimits = SandboxLimits(), files: Mapping[str, bytes] | None = None,
             mounts: tuple[Mount, ...] = (), network: bool = False) -> LocalSandbox:
        sb = LocalSandbox(limits)
        for p, d in (files or {}).items():
            sb.write_file(p, d)
        self.opened.append(sb)
        return sb
