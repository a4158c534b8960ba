"""Test doubles. `LocalBackend` implements the SandboxBackend interface with plain subprocesses in a temp
dir: it is NOT a sandbox and exists only so framework tests (budgets, malformed output, registry) do not
depend on bubblewrap. Terminal-domain tests that claim anything about isolation use the real backend.

It follows the interface's data rules, though (artifacts go through `safefs`: no symlinks, regular
files, caps), so code written against it behaves the same on the real backend. Each sandbox's temp dir
is laid out like a tiny root: the work dir at `<tmp>/work` and, for `open_pristine`, the agent's copy
at `<tmp>/<agent_dir>`, so `../agent/x` from the work dir names the same file as on bubblewrap (there
is no mount namespace to put it at an absolute `/agent`).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Mapping

from envs.sandbox import safefs
from envs.sandbox.base import ExecResult, Mount, PathStat, Sandbox, SandboxBackend, SandboxLimits


class LocalSandbox(Sandbox):
    def __init__(self, limits: SandboxLimits) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="jointrl-fake-"))
        self.root = self.base / "work"
        self.root.mkdir()
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
        safefs.write_file(str(self.root), path, data, mode, inside_prefix=self.workdir_inside)

    def read_artifact(self, path: str, max_bytes: int = 1_000_000) -> bytes:
        return safefs.read_file(str(self.root), path, max_bytes, inside_prefix=self.workdir_inside)

    def stat_artifact(self, path: str) -> PathStat:
        return safefs.stat_path(str(self.root), path, inside_prefix=self.workdir_inside)

    def list_artifacts(self, max_files: int = 10_000) -> list[str]:
        return safefs.list_files(str(self.root), max_files)

    def kill_all(self) -> None:
        self.kills += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            shutil.rmtree(self.base, ignore_errors=True)


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

    def open_pristine(self, *, agent: Sandbox | Mapping[str, bytes] | None, files: Mapping[str, bytes] | None = None,
                      limits: SandboxLimits = SandboxLimits(), mounts: tuple[Mount, ...] = (),
                      agent_dir: str = "/agent", max_agent_files: int = 10_000,
                      max_agent_file_bytes: int = 32 * 1024 * 1024) -> LocalSandbox:
        """The interface's copy rules (kill first, regular files only, caps recorded); no pristine root."""
        rel_dir = agent_dir.strip("/")
        if not agent_dir.startswith("/") or not rel_dir or rel_dir.split("/")[0] == "work" or ".." in rel_dir.split("/"):
            raise ValueError(f"agent_dir must be an absolute path outside the work dir, got {agent_dir!r}")
        if isinstance(agent, Sandbox):
            agent.kill_all()
        sb = self.open(limits=limits, files=files, mounts=mounts)
        dst = sb.base / rel_dir
        dst.mkdir(parents=True)
        report = safefs.copy_agent_files(agent, str(dst), max_files=max_agent_files, max_file_bytes=max_agent_file_bytes)
        if report is not None:
            sb.agent_copy = report
        return sb
