"""Shared fixtures for the bwrap sandbox tests (functional tests and the attack suite)."""
from __future__ import annotations

import os
import time

import pytest

from envs.sandbox import hostctl
from envs.sandbox.base import SandboxLimits, SandboxUnavailable

# Small limits keep the attacks fast on a shared 2-core machine.
SMALL = SandboxLimits(workdir_mb=16, tmp_mb=8, max_procs=32, address_space_mb=512, file_size_mb=8,
                      cpu_seconds=5, open_files=128, max_output_bytes=64 * 1024)


def make_backend():
    from envs.sandbox.bwrap import BwrapBackend

    try:
        return BwrapBackend()
    except SandboxUnavailable as e:  # not root / no bubblewrap: nothing here can run
        pytest.skip(f"bwrap sandbox unavailable on this host: {e}")


def uid_pids(uid: int) -> list[int]:
    return hostctl.pids_of_uid(uid)


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def assert_only_executor_left(box, timeout_s: float = 2.0) -> None:
    """Between commands a live sandbox has exactly bwrap (outside) and the executor (pid 1 inside)."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = sorted(comm(p) for p in uid_pids(box.uid))
        if names in (["bwrap", "python3"], ["bwrap", "python3.11"], []):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leftover processes of uid {box.uid}: {names}")
        time.sleep(0.02)


def assert_no_process(uid: int, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while uid_pids(uid):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of uid {uid} left: {[comm(p) for p in uid_pids(uid)]}")
        time.sleep(0.02)


def host_alive() -> None:
    os.kill(os.getpid(), 0)
