"""ThreadedGenerate: every waiting batch reaches a blocking generate() at once, beyond asyncio's default pool."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from rl.rollout.agent_loop import ThreadedGenerate


def test_more_blocking_calls_in_flight_than_the_default_pool_allows():
    # asyncio.to_thread's default pool has min(32, cores + 4) threads; ask for more calls than that,
    # each blocked until all of them have arrived: this passes only if they are all in flight together.
    n = min(32, (os.cpu_count() or 1) + 4) + 4
    barrier = threading.Barrier(n, timeout=30)

    def generate(requests):
        barrier.wait()  # BrokenBarrierError after 30 s if fewer than n calls ever run at once
        return [r * 10 for r in requests]

    async def go():
        async with ThreadedGenerate(generate, max_threads=n) as g:
            return await asyncio.gather(*(g([i, i + 1]) for i in range(n)))

    out = asyncio.run(go())
    assert out == [[10 * i, 10 * (i + 1)] for i in range(n)]


def test_errors_reach_the_caller_and_bad_sizes_are_refused():
    def generate(requests):
        raise RuntimeError("engine down")

    async def go():
        async with ThreadedGenerate(generate, max_threads=2) as g:
            await g([1])

    with pytest.raises(RuntimeError, match="engine down"):
        asyncio.run(go())
    with pytest.raises(ValueError, match="max_threads"):
        ThreadedGenerate(generate, max_threads=0)
