"""Where the project lives on disk: the repository root, the cache root, and the lock that builders of
a cache entry hold while they build it. Nothing else.

Every cache (vLLM, torch extensions, Ray temp, HF, built task sets and corpora) lives under one
root: `$JOINTRL_CACHE` when set, else `.cache/` in the repository. `rl.paths.setup_cache_env`
points the libraries' own cache variables at sub-folders of it.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_root(default: str | os.PathLike[str] = ".cache") -> Path:
    """The cache root: `$JOINTRL_CACHE` if set, else `default`; relative paths are taken from the
    repository root. Read at each call, since a launcher may set the variable late."""
    p = Path(os.environ.get("JOINTRL_CACHE") or default)
    return p if p.is_absolute() else REPO_ROOT / p


@contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created with its parents) for the block: concurrent
    processes building the same cache entry build it once, the others wait and then find it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
