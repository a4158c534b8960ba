"""Sandboxes for agent commands: the interface (`base`) and the bubblewrap backend (`bwrap`).

`BwrapBackend` is imported lazily so that `from envs.sandbox import SandboxLimits` works on hosts
without bubblewrap.
"""
from envs.sandbox.base import (CopyReport, ExecResult, Mount, PathStat, Sandbox, SandboxBackend, SandboxLimits,
                               SandboxUnavailable)
from envs.sandbox.safefs import ArtifactError

__all__ = ["ArtifactError", "BwrapBackend", "BwrapConfig", "BwrapSandbox", "CopyReport", "ExecResult", "Mount", "PathStat",
           "Sandbox", "SandboxBackend", "SandboxLimits", "SandboxUnavailable"]


def __getattr__(name: str):
    if name in ("BwrapBackend", "BwrapConfig", "BwrapSandbox"):
        from envs.sandbox import bwrap

        return getattr(bwrap, name)
    raise AttributeError(name)
