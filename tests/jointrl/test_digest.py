"""jointrl/digest.py: a file's sha256 read in chunks equals the sha256 of its bytes read at once."""
from __future__ import annotations

import hashlib
import os

from jointrl.digest import sha256_file


def test_chunked_digest_equals_the_one_shot_digest(tmp_path):
    data = os.urandom(10_000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert [sha256_file(f, chunk_bytes=n) for n in (1, 333, 10_000, 1 << 20)] == [want] * 4
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(str(tmp_path / "empty")) == hashlib.sha256(b"").hexdigest()
