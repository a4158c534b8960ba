"""The exceptions of the weight-sync package.

`WeightSyncError`: a state dict that cannot be named, bucketed, encoded or decoded (the message
names the tensor), or a bad argument. `ShmSyncError`: a shared-memory sync that cannot be read or
written safely. `ShmSpaceError`: /dev/shm has no room for a slot. Nothing else lives here.
"""
from __future__ import annotations


class WeightSyncError(ValueError):
    """A state dict that cannot be converted, bucketed or decoded; the message names the tensor."""


class ShmSyncError(WeightSyncError):
    """A shared-memory sync that cannot be read or written safely (torn, stale, busy, missing, foreign node)."""


class ShmSpaceError(ShmSyncError):
    """/dev/shm has no room for a slot (the automatic choice then falls back to the object store)."""
