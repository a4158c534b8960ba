"""Batching generation requests of concurrent episodes: `BatchingGenerator` (one engine call for every episode
waiting on generation) and `ThreadedGenerate` (a blocking engine as an async batch call, one thread per waiting
batch). Used by the agent loop (rl/rollout/agent_loop.py, which re-exports both). Nothing here knows episodes.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from rl.rollout.engine import GenerateRequest, GenerateResult

GenerateBatch = Callable[[list[GenerateRequest]], Awaitable[list[GenerateResult]]]


class BatchingGenerator:
    """Collects concurrent GenerateRequests and sends them to the engine in batches.

    A batch is flushed as soon as every live episode is waiting on generation, or after
    `max_wait_s` since the first queued request, whichever comes first.
    """

    def __init__(self, generate_batch: GenerateBatch, max_wait_s: float = 0.02, max_batch: int = 256) -> None:
        self._gen = generate_batch
        self._max_wait = max_wait_s
        self._max_batch = max_batch
        self._queue: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._live = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.requests = 0

    def episode_started(self) -> None:
        self._live += 1

    def episode_finished(self) -> None:
        self._live -= 1
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        fut: asyncio.Future = loop.create_future()
        self._queue.append((req, fut))
        self._poke()
        return await fut

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                continue
            t0 = time.monotonic()
            while len(self._queue) < min(self._live, self._max_batch) and time.monotonic() - t0 < self._max_wait:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self._max_wait)
                except asyncio.TimeoutError:
                    break
                self._wake.clear()
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            if self._queue:
                self._wake.set()
            asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[tuple[GenerateRequest, asyncio.Future]]) -> None:
        self.batches += 1
        self.requests += len(batch)
        try:
            results = await self._gen([r for r, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} requests")
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)
        except BaseException as e:  # noqa: BLE001 - every waiting episode must hear about it
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)


class ThreadedGenerate:
    """Turns a blocking `generate(requests) -> results` (a RolloutDispatcher, a RolloutEngine) into a
    `GenerateBatch`, on a thread pool of its own with one thread per episode that can be waiting.

    Each call holds its thread until its whole batch is done, while the engine batches continuously
    across calls. `asyncio.to_thread` would use the loop's default pool (cores + 4 threads): on 2 cores
    that let only ~6 batches reach the engine at once, so a 64-episode evaluation ran ~8 requests per
    engine step (docs/training.md, attempt 8). Use as an async context manager; the pool closes on exit.
    """

    def __init__(self, generate: Callable[[list[GenerateRequest]], list[GenerateResult]], max_threads: int) -> None:
        import concurrent.futures

        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self._generate = generate
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="jointrl-generate")

    async def __call__(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._generate, requests)

    async def __aenter__(self) -> "ThreadedGenerate":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
