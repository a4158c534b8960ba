"""The sha256 of a file on disk, read in chunks: what pinned downloads (model/hub.py, envs/swe/libraries.py)
and sharded weights (rl/weights/objstore.py) check against. It does not fetch, cache or compare anything.
"""
from __future__ import annotations

import hashlib
import os

CHUNK_BYTES = 8 << 20  # large enough that a multi-GB shard is not read in millions of calls


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()
