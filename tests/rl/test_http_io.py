"""rl/http_io.py: the bounded body read the jobs API and the tinker service share, and the free port."""
from __future__ import annotations

import asyncio
import socket

import pytest

from rl.http_io import BodyTooLarge, free_port, read_body


class _Request:
    """What read_body reads of a Starlette request: its headers and its body stream (chunks as a client sends them)."""

    def __init__(self, chunks: list[bytes], content_length: str | None) -> None:
        self.headers = {} if content_length is None else {"content-length": content_length}
        self.chunks, self.read = chunks, 0

    async def stream(self):
        for c in self.chunks:
            self.read += 1
            yield c


def _read(req: _Request, limit: int) -> bytes:
    return asyncio.run(read_body(req, limit))


def test_a_body_within_the_limit_is_returned_whole():
    assert _read(_Request([b"ab", b"cd", b"e"], "5"), 5) == b"abcde"


def test_a_declared_length_past_the_limit_is_refused_before_reading():
    req = _Request([b"x" * 10], "10")
    with pytest.raises(BodyTooLarge, match="request body over 4 bytes"):
        _read(req, 4)
    assert req.read == 0


@pytest.mark.parametrize("declared", [None, "3", "abc", "9" * 30])  # missing, lying, not a number, absurd
def test_a_stream_past_the_limit_is_cut_off_whatever_the_header_says(declared):
    req = _Request([b"xx", b"xx", b"xx", b"xx"], declared)
    with pytest.raises(BodyTooLarge):
        _read(req, 5)
    assert req.read == 3  # stopped at the chunk that crossed the limit, not at the end


def test_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
