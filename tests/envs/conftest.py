"""Shared fixtures for the environment tests."""
from __future__ import annotations

import pytest

from envs.sandbox.base import SandboxUnavailable


@pytest.fixture(scope="module")
def backend():
    """A real bubblewrap backend (one per test module); skips where the kernel refuses namespaces."""
    try:
        from envs.sandbox.bwrap import BwrapBackend

        b = BwrapBackend()
        b.open().close()
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap sandbox unavailable on this host: {e}")
    return b
