"""The chat service's capacity: how many requests it admits, and what it reports about its load.

- `Admission`: at most `max_running` requests generate at once, at most `max_queue` wait (first come, first
  served); beyond that `acquire` raises 429 with `Retry-After`. A released slot is handed to the next waiter
  directly, so a burst cannot overtake the queue.
- `ServeMetrics`: Prometheus counters, gauges and histograms in the service's own registry (requests, queue
  depth, tokens, throughput over the last 10 s, latency, time to first token).

What it does not do: decide what a request generates (rl/serve/service.py) or answer HTTP (rl/serve/app.py).
Both classes are used from the event loop only.
"""
from __future__ import annotations

import asyncio
import collections
import time

from rl.serve.core import ApiError


class Admission:
    """A bounded admission queue in front of the engine (event-loop only)."""

    def __init__(self, max_running: int, max_queue: int) -> None:
        self.max_running, self.max_queue = max_running, max_queue
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, retry_after_s: float) -> None:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise ApiError(429, f"the server is at capacity ({self.running} requests running, {len(self._waiters)} queued, "
                                f"--max-queue {self.max_queue}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(max(1, round(retry_after_s)))})
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over: `running` is not decremented in between
        except BaseException:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as the waiter was cancelled
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


class ServeMetrics:
    """Prometheus metrics of one service, in their own registry (several services can live in one process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jointrl_serve_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.running = Gauge("jointrl_serve_requests_running", "requests generating now", registry=r)
        self.queue_depth = Gauge("jointrl_serve_queue_depth", "requests waiting for admission", registry=r)
        self.engine_running = Gauge("jointrl_serve_engine_running", "requests the engine scheduler is running", registry=r)
        self.kv_usage = Gauge("jointrl_serve_kv_cache_usage", "fraction of KV-cache blocks in use", registry=r)
        self.prompt_tokens = Counter("jointrl_serve_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("jointrl_serve_generated_tokens", "tokens generated", registry=r)
        self.tokens_per_s = Gauge("jointrl_serve_generated_tokens_per_second", "tokens generated per second over the last 10 s", registry=r)
        self.aborted = Counter("jointrl_serve_aborted", "requests aborted because the client went away", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.latency = Histogram("jointrl_serve_request_latency_seconds", "request latency", ["route"], buckets=buckets, registry=r)
        self.ttft = Histogram("jointrl_serve_time_to_first_token_seconds", "time to the first generated token", ["route"],
                              buckets=buckets, registry=r)
        self._window: collections.deque[tuple[float, int]] = collections.deque()

    def count_tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)
        now = time.monotonic()
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - 10:
            self._window.popleft()

    def refresh(self) -> None:
        now = time.monotonic()
        while self._window and self._window[0][0] < now - 10:
            self._window.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._window) / 10.0)
