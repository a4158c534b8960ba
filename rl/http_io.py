"""HTTP plumbing the services share (`jointrl jobs`, `jointrl tinker serve`, their launchers and tests).

- `read_body(request, limit)`: a request's body, at most `limit` bytes: refused before reading when the
  content-length says more, and while it streams in otherwise (a missing or lying content-length cannot
  pass the limit). Each service turns `BodyTooLarge` into its own error answer.
- `free_port()`: a free TCP port on the loopback interface, for a child server to bind.

What it does not do: decode the body (JSON, protobuf, zstd) or pick status codes; those stay with each service.
It imports nothing from the project, so any subpackage may use it.
"""
from __future__ import annotations

import socket
from typing import Any


class BodyTooLarge(Exception):
    """A request body over `limit` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette `request`, at most `limit` bytes, else `BodyTooLarge` (see the module docstring)."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isascii() and cl.isdigit() and len(cl) < 20 and int(cl) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
