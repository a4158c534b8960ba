"""What stands in front of the jobs API (a rate limit, API keys, bounded request bodies) and the policy server (its key, bounded bodies).

- Keys (`check_key`, `keys_from`): printable ASCII, no spaces or commas, never empty or blank; refused
  at start-up with a `ConfigError` naming where the key came from. `jointrl jobs serve` takes one or
  more (`--api-key`, repeatable, or `$JOINTRL_JOBS_API_KEY`, comma-separated), one per client; the
  policy server takes exactly one (`$JOINTRL_POLICY_API_KEY`).
- `RateGate`: ASGI middleware, outermost on the jobs API: a token bucket per client address
  (rl/ratelimit.py, `--rate-limit-per-s` / `--rate-limit-burst`); past it 429 with `Retry-After`,
  answered before the key check and before any body byte is read, so a flood (with or without a key,
  with bodies that would take parsing) costs one bucket update and a small reply per request. The
  policy server has none: its only clients are the jobs service's own workers, all on one loopback
  address, and a 429 there would fail their jobs (rl/jobs/policy.py says why it needs none).
- `KeyGate`: ASGI middleware. With keys set, every HTTP request must carry one
  (`Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time) or gets 401. The
  request's owner (`key_id(KEY)`, a hash: the database never holds a key) is put in
  `scope["state"]["owner"]` for the routes; without keys the owner is None.
- `read_json(request, limit)`: the body, at most `limit` bytes (413 past it, before reading when
  Content-Length says so), decoded as JSON with every decoding failure a 400: invalid UTF-8, invalid
  JSON, nesting deeper than `MAX_DEPTH`, integers past Python's digit limit.

What this module does not do: TLS, per-key quotas (the rate limit goes by address: behind a proxy every
client is the proxy, so raise or turn off the limit there), or check what a body means.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Callable, Iterable, Sequence

from rl.config import ConfigError
from rl.http_io import BodyTooLarge, read_body
from rl.ratelimit import RateLimiter, client_id

JOBS_KEY_ENV = "JOINTRL_JOBS_API_KEY"  # the jobs server: accepted keys, comma-separated; a client: the key it sends
POLICY_KEY_ENV = "JOINTRL_POLICY_API_KEY"  # the policy server's key (the jobs server makes a fresh one per start)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_DEPTH = 32  # no body of either service nests deeper than 3


def check_key(key: object, where: str) -> str:
    """`key` if it is usable; ConfigError naming `where` otherwise."""
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"{where}: the API key is empty or blank; give a real key, or none at all (loopback only)")
    if any(ord(c) < 0x21 or ord(c) > 0x7E or c == "," for c in key):
        raise ConfigError(f"{where}: an API key must be printable ASCII without spaces or commas (it travels in an HTTP header)")
    return key


def keys_from(flag_keys: Sequence[str] | None, env: dict[str, str] | Any, env_name: str = JOBS_KEY_ENV) -> tuple[str, ...]:
    """The keys a server accepts: the `--api-key` flags if any were given, else `$env_name` split on commas.
    A variable that is set must hold keys: set but empty is refused like an empty flag."""
    if flag_keys:
        return tuple(check_key(k, "--api-key") for k in flag_keys)
    raw = env.get(env_name)
    if raw is None:
        return ()
    return tuple(check_key(k, f"${env_name}") for k in raw.split(","))


def key_id(key: str) -> str:
    """What the database records as a job's owner: a hash of the key that submitted it."""
    return hashlib.sha256(b"jointrl-jobs-owner\0" + key.encode()).hexdigest()[:32]


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    for k, v in headers:
        if k == b"x-api-key":
            return v.strip()
        if k == b"authorization" and v[:7].lower() == b"bearer ":
            return v[7:].strip()
    return None


async def _refuse(send: Callable, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer `{"detail": ...}` with `status` from a middleware, without reading the request."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RateGate:
    """ASGI middleware: 429 with Retry-After for a client address past its token bucket; placed outside KeyGate."""

    def __init__(self, app: Any, limiter: RateLimiter) -> None:
        self.app, self.limiter = app, limiter

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        wait = self.limiter.take(client_id(scope)) if scope["type"] == "http" else None
        if wait is None:
            return await self.app(scope, receive, send)
        await _refuse(send, 429, self.limiter.refusal(), [(b"retry-after", self.limiter.retry_after(wait).encode())])


class KeyGate:
    """ASGI middleware: 401 without one of `keys`; the caller's owner id in scope["state"]["owner"]."""

    def __init__(self, app: Any, keys: Sequence[str]) -> None:
        self.app = app
        self._keys = [(k.encode(), key_id(k)) for k in keys]

    def owner(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        got = presented_key(headers)
        if not got:
            return None
        match = None
        for raw, oid in self._keys:  # compare with every key: the time does not say which one matched
            if hmac.compare_digest(got, raw):
                match = oid
        return match

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not self._keys:
            return await self.app(scope, receive, send)
        owner = self.owner(scope["headers"])
        if owner is None:
            return await _refuse(send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                 [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["owner"] = owner
        return await self.app(scope, receive, send)


class BodyError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _depth_ok(x: Any, limit: int) -> bool:
    stack = [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            if d > limit:
                return False
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Decode a body; BodyError(400) for anything that is not JSON within `max_depth` levels."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the body is not UTF-8: {e}") from None
    # a cheap bound before the parser recurses: nesting needs at least one bracket per level
    if text.count("[") + text.count("{") > max_depth and not _depth_ok_text(text, max_depth):
        raise BodyError(400, f"the body nests deeper than {max_depth} levels")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError also covers ints past sys.get_int_max_str_digits()
        raise BodyError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not _depth_ok(value, max_depth):
        raise BodyError(400, f"the body nests deeper than {max_depth} levels")
    return value


def _depth_ok_text(text: str, limit: int) -> bool:
    """Bracket depth outside strings stays within `limit` (a linear scan; no recursion)."""
    depth, in_str, esc = 0, False, False
    for c in text:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth > limit:
                return False
        elif c in "]}":
            depth -= 1
    return True


async def read_json(request: Any, limit: int, max_depth: int = MAX_DEPTH) -> Any:
    """The request's JSON body, bounded: BodyError 413 past `limit` bytes, 400 for bodies that do not decode."""
    try:
        data = await read_body(request, limit)
    except BodyTooLarge:
        raise BodyError(413, f"the body is larger than this server's limit of {limit} bytes") from None
    return parse_json(data, max_depth)


def short(v: object, n: int = 80) -> str:
    """repr(v) cut to `n` characters, for error messages that echo client input."""
    r = repr(v) if not isinstance(v, int) or isinstance(v, bool) or abs(v) < 10**30 else f"<an integer of {len(str(abs(v)))} digits>"
    return r if len(r) <= n else r[: n - 3] + "..."
