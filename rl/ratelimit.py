"""Per-client request rate limits for the HTTP services: one token bucket per client, refused before the body is read.

- `TokenBucket` semantics (the classic leaky/token bucket, e.g. RFC 2697's committed-burst bucket): a
  client's bucket holds at most `burst` tokens and refills at `per_s` tokens per second; each request takes
  one. A request that finds less than one token is refused with the wait until one is there
  (`Retry-After`, whole seconds rounded up, at least 1).
- `RateLimiter(per_s, burst)`: the buckets by client id. `per_s <= 0` turns it off (every request passes).
  At most `max_clients` buckets are kept; past that the longest-unseen one is dropped (a client seen again
  starts with a full bucket, which only favours it), so a caller rotating addresses cannot grow memory.
- `client_id(scope)`: the ASGI client address (host only: a client opens many connections from many
  ports). Forwarded-for headers are not trusted, since any client can write them; behind a proxy every
  client is the proxy, so raise or turn off the limit there.

What it does not do: weigh requests by cost (admission queues and body limits bound that), or share
buckets between processes.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable


def client_id(scope: dict) -> str:
    """The client's address from an ASGI scope ("?" when the server does not know it, e.g. a Unix socket)."""
    client = scope.get("client")
    return str(client[0]) if client else "?"


class RateLimiter:
    """Token buckets by client id: `take(client)` is None when the request may go on, else the seconds to wait."""

    def __init__(self, per_s: float, burst: int, max_clients: int = 65_536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if per_s > 0 and burst < 1:
            raise ValueError(f"a rate limit needs burst >= 1, got {burst}")
        self.per_s, self.burst, self.max_clients, self.clock = float(per_s), int(burst), max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, time of that count)

    @property
    def enabled(self) -> bool:
        return self.per_s > 0

    def take(self, client: str) -> float | None:
        if not self.enabled:
            return None
        now = self.clock()
        tokens, then = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.per_s)
        wait = None
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.per_s
        self._buckets[client] = (tokens, now)  # re-inserted last: the dict runs from longest-unseen to latest
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait

    @staticmethod
    def retry_after(wait_s: float) -> str:
        return str(max(1, math.ceil(wait_s)))

    def refusal(self) -> str:
        """The text a refused request gets (every service that limits answers with it)."""
        return (f"too many requests from this client: at most {self.per_s:g} per second (bursts of {self.burst}); "
                "retry after the Retry-After seconds")

    def __len__(self) -> int:
        return len(self._buckets)
