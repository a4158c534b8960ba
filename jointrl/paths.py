"""Where the project lives on disk: the repository root and the cache root. Nothing else.

Every cache (vLLM, torch extensions, Ray temp, HF, built task sets and corpora) lives under one
root: `$JOINTRL_CACHE` when set, else `.cache/` in the repository. `rl.paths.setup_cache_env`
points the libraries' own cache variables at sub-folders of it.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_root(default: str | os.PathLike[str] = ".cache") -> Path:
    """The cache root: `$JOINTRL_CACHE` if set, else `default`; relative paths are taken from the
    repository root. Read at each call, since a launcher may set the variable late."""
    p = Path(os.environ.get("JOINTRL_CACHE") or default)
    return p if p.is_absolute() else REPO_ROOT / p
