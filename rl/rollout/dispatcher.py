"""`RolloutDispatcher`: N rollout workers behind one call, balanced by outstanding requests, surviving restarts.

- Balancing: each request goes to the worker with the fewest outstanding requests (counted across all
  concurrent callers), so one batch is spread evenly and concurrent batches fill idle workers first.
  A worker gets its share as one call, so vLLM batches it.
- Restarts: when a call fails because its actor died (`RayActorError`: `ray.kill`, a crash, or its whole
  node gone), was killed by Ray's memory monitor while running it (`OutOfMemoryError`, which is not a
  `RayActorError`), or its result was lost with the node that held it (`ObjectLostError`), the dispatcher
  builds a replacement with `worker_factory()` (Ray places it on a surviving node that satisfies the
  factory's resources), re-applies the latest weight sync (kept as object refs, so nothing is copied
  again) and re-sends the dead worker's requests, up to `max_retries` times per batch. Every request
  gets exactly one result: the results of a failed call are discarded whole and its requests re-sent.
  A replacement that dies while starting is replaced again (up to `max_retries` times). Other errors
  (a bad request) propagate unchanged.
- Weight sync: `update_weights(buckets, version)` puts each bucket in Ray's object store once and
  sends the refs to every worker. Buckets are `WeightBucket`s (the payload) or `ShmBucket`s (a small
  index into the trainer's same-node shared memory, rl/weights/); `reader_nodes()` gives the
  workers' Ray node ids so the trainer can choose. A restart replays the last sync; if that was a
  shm sync and the replacement landed on another node, the replay fails loudly (same-node only).

What it does not do: decide when to sync (the driver does) or run episodes.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from rl.rollout.engine import GenerateRequest, GenerateResult, WeightUpdateStats

log = logging.getLogger(__name__)


class DispatchError(RuntimeError):
    """Requests could not be served even after restarting workers."""


RESTART_WAIT_LOG_S = 60.0  # how often a replacement that has not started yet is reported
RESTART_BACKOFF_S = 5.0  # wait before the second try at starting a replacement; doubled for each later one


def _get_while_logging(ref: Any, w: int, t0: float) -> Any:
    """`ray.get(ref)` that says every RESTART_WAIT_LOG_S why the driver is waiting: a replacement waits
    for a node with its resources free (none may be left after a node loss), then for its engine."""
    import ray

    while not ray.wait([ref], timeout=RESTART_WAIT_LOG_S)[0]:
        log.warning("replacement for rollout worker %d not serving after %.0f s: it needs a node with its resources "
                    "free (see `ray status`), then its engine start", w, time.perf_counter() - t0)
    return ray.get(ref)


@dataclass
class _Slot:
    handle: Any
    generation: int = 0  # bumped on every restart
    outstanding: int = 0
    restarts: int = 0
    node_id: str | None = None  # the worker's Ray node id, asked once per (re)start



def worker_lost_errors() -> tuple[type[BaseException], ...]:
    """The Ray errors that mean "this worker (or its result) is gone", after which the dispatcher restarts the
    worker and re-sends its requests. Ray's memory monitor raises `OutOfMemoryError` for the task of a
    worker it killed; that class is not a `RayActorError` (measured: a learning run's engine killed this way
    ended the run before it was listed here)."""
    from ray.exceptions import ObjectLostError, OutOfMemoryError, RayActorError

    return (RayActorError, ObjectLostError, OutOfMemoryError)

class RolloutDispatcher:
    def __init__(self, worker_factory: Callable[[], Any], n: int, max_retries: int = 2) -> None:
        if n <= 0:
            raise ValueError(f"RolloutDispatcher: n must be > 0, got {n}")
        self._factory = worker_factory
        self._lock = threading.Lock()
        self._slots = [_Slot(handle=worker_factory()) for _ in range(n)]
        self.max_retries = max_retries
        self._latest: tuple[list[Any], int] | None = None  # (bucket refs, version) of the last sync

    # -- balancing
    def _assign(self, indices: Sequence[int]) -> dict[int, tuple[list[int], Any, int]]:
        """worker -> (request indices, its handle, its generation), read together under the lock so a
        failure is blamed on the worker generation that actually served the call."""
        out: dict[int, tuple[list[int], Any, int]] = {}
        with self._lock:
            for i in indices:
                w = min(range(len(self._slots)), key=lambda k: self._slots[k].outstanding)
                self._slots[w].outstanding += 1
                out.setdefault(w, ([], self._slots[w].handle, self._slots[w].generation))[0].append(i)
        return out

    def _release(self, w: int, count: int) -> None:
        with self._lock:
            self._slots[w].outstanding -= count

    def _restart(self, w: int, generation: int) -> None:
        """Replace worker w unless another caller already did; give it the latest weights first."""
        import ray

        with self._lock:
            slot = self._slots[w]
            if slot.generation != generation:
                return
            log.warning("rollout worker %d (node %s) died; restarting it", w, slot.node_id or "not asked yet")
            t0 = time.perf_counter()
            for attempt in range(self.max_retries + 1):
                try:
                    ray.kill(slot.handle)
                except Exception:  # already gone
                    pass
                slot.handle = self._factory()
                try:
                    if self._latest is not None:
                        refs, version = self._latest
                        _get_while_logging(slot.handle.update_weights.remote(refs, version), w, t0)
                    slot.node_id = _get_while_logging(slot.handle.health.remote(), w, t0).node_id
                    break
                except worker_lost_errors() as e:
                    # e.g. placed on a node that was going away before Ray marked it dead
                    if attempt == self.max_retries:
                        raise DispatchError(f"rollout worker {w}: {attempt + 1} replacements died while starting") from e
                    # Back off before the next try: a replacement killed for memory needs the peak that
                    # killed it (often another actor's step) to pass first.
                    wait_s = RESTART_BACKOFF_S * 2 ** attempt
                    log.warning("replacement for rollout worker %d died while starting (%s); trying again in %.0f s", w,
                                type(e).__name__, wait_s)
                    time.sleep(wait_s)
            slot.generation += 1
            slot.restarts += 1
            log.warning("rollout worker %d restarted on node %s in %.1f s", w, slot.node_id, time.perf_counter() - t0)

    # -- the public surface
    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return self._fan_out("generate", list(requests))

    def score(self, token_ids_list: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self._fan_out("score", [tuple(s) for s in token_ids_list])

    def _fan_out(self, method: str, items: list[Any]) -> list[Any]:
        import ray

        results: list[Any] = [None] * len(items)
        todo = list(range(len(items)))
        for attempt in range(self.max_retries + 1):
            if not todo:
                break
            calls: dict[Any, tuple[int, list[int], int]] = {}
            for w, (idxs, handle, gen) in self._assign(todo).items():
                calls[getattr(handle, method).remote([items[i] for i in idxs])] = (w, idxs, gen)
            failed: list[int] = []
            pending = list(calls)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                w, idxs, gen = calls[done[0]]
                try:
                    out = ray.get(done[0])
                except worker_lost_errors() as e:
                    log.warning("worker %d failed during %s (%s): retrying %d requests", w, method, type(e).__name__, len(idxs))
                    self._restart(w, gen)
                    failed.extend(idxs)
                    continue
                finally:
                    self._release(w, len(idxs))
                for i, r in zip(idxs, out):
                    results[i] = r
            todo = failed
        if todo:
            raise DispatchError(f"{len(todo)} requests failed after {self.max_retries} worker restarts")
        return results

    def update_weights(self, buckets: Sequence[Any], version: int) -> list[WeightUpdateStats]:
        """Send one weight sync (buckets, shm indexes, or refs to them) to every worker at once; remembered for restarts."""
        import ray

        from rl.weights import ShmBucket

        # Payload buckets go to the object store once (every worker reads the same copy); a shm index
        # is a few KB and travels inline with the call.
        refs = [b if isinstance(b, (ray.ObjectRef, ShmBucket)) else ray.put(b) for b in buckets]
        self._latest = (refs, int(version))
        calls = [(w, s.generation, s.handle.update_weights.remote(refs, int(version))) for w, s in enumerate(self._slots)]
        out: list[WeightUpdateStats] = []
        for w, gen, ref in calls:
            try:
                out.append(ray.get(ref))
            except worker_lost_errors():
                self._restart(w, gen)  # the replacement is given these latest weights before it serves
                h = ray.get(self._slots[w].handle.health.remote())
                out.append(WeightUpdateStats(num_tensors=0, num_bytes=0, seconds=0.0, repacked_moe_layers=0, policy_version=h.policy_version))
        return out

    def reader_nodes(self) -> list[str]:
        """Ray node id of every worker ("" for one outside Ray): who reads the next weight sync.

        Asked once per worker start; a worker found dead is restarted here (as `update_weights` would).
        """
        import ray

        for w, s in enumerate(self._slots):
            if s.node_id is not None:
                continue
            gen = s.generation
            try:
                s.node_id = ray.get(s.handle.health.remote()).node_id
            except worker_lost_errors():
                self._restart(w, gen)  # records the replacement's node as it starts
        return [s.node_id or "" for s in self._slots]

    def health(self) -> list[Any]:
        import ray

        return ray.get([s.handle.health.remote() for s in self._slots])

    @property
    def restarts(self) -> list[int]:
        return [s.restarts for s in self._slots]

    @property
    def handles(self) -> list[Any]:
        return [s.handle for s in self._slots]

    def shutdown(self) -> None:
        import ray

        for s in self._slots:
            try:
                ray.get(s.handle.shutdown.remote(), timeout=60)
            except Exception:
                pass
            try:
                ray.kill(s.handle)
            except Exception:
                pass
