"""The jobs HTTP API (FastAPI) and its Prometheus metrics.

Routes: `POST /v1/jobs` (a `JobSpec` body -> `{"id"}`), `GET /v1/jobs/{id}` (status, attempts,
result), `GET /v1/jobs/{id}/events` (Server-Sent Events, one per stored event; `Last-Event-ID` or
`?after=SEQ` resumes, so a client that lost the server reconnects without missing or repeating
events), `DELETE /v1/jobs/{id}` (cancel), `GET /v1/jobs/workers` (replica names and pids),
`GET /metrics` (replicas, queue depth, in-flight jobs, job latency), `GET /health`.

The database is the source of truth for every answer, so any server process over the same database
answers the same (a restarted server included). The event stream polls the database; it ends after
the job's final event.

Who may do what: a per-client rate limit (rl/jobs/guard.py: RateGate) answers 429 with `Retry-After`
before anything else, the key check and the body included. With API keys (`api_keys`, rl/jobs/guard.py: KeyGate) every route needs one, and a job
belongs to the key that submitted it: its status, events and cancel answer 404 to any other key, the
same answer as for an id that does not exist (so ids cannot be probed). Without keys (loopback only,
enforced by the server) there are no owners. Bodies are read bounded (`MAX_BODY_BYTES`, 413) and every
malformed body, field or query is a 4xx naming what is wrong, never a 500.

What this module does not do: run jobs or scale workers (it reads the pool and autoscaler it is given).
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import asdict
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rl.config import ConfigError
from rl.jobs.broker import Broker
from rl.jobs.guard import BodyError, KeyGate, RateGate, read_json, short
from rl.jobs.records import FINAL_STATUSES, JobSpec, JobView
from rl.jobs.store import JobStore
from rl.ratelimit import RateLimiter

EVENT_POLL_S = 0.2
FINAL_EVENTS = frozenset({"done", "failed", "cancelled", "dead_letter"})
MAX_BODY_BYTES = 16 * 1024  # a job spec is ~100 bytes
MAX_SEQ = 2**63 - 1  # event sequence numbers are SQLite integers


def _seq(value: str | None, where: str) -> int | None:
    """An event sequence number from a query or header: ASCII digits in [0, 2^63); 422 otherwise."""
    if value is None or value == "":
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 19 and int(value) <= MAX_SEQ):
        raise HTTPException(status_code=422, detail=f"{where} must be an event sequence number (an integer in [0, 2^63)), "
                                                    f"got {short(value)}")
    return int(value)


class JobsMetrics:
    """Prometheus gauges and the latency histogram, on their own registry (one app per process in tests)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.replicas = Gauge("jointrl_jobs_replicas", "agent-worker replicas running (not draining)", registry=self.registry)
        self.target = Gauge("jointrl_jobs_replicas_target", "replicas the autoscaler asks for", registry=self.registry)
        self.queue_depth = Gauge("jointrl_jobs_queue_depth", "jobs in the stream not yet taken by a worker", registry=self.registry)
        self.in_flight = Gauge("jointrl_jobs_in_flight", "jobs taken by a worker and not yet acknowledged", registry=self.registry)
        self.latency = Histogram("jointrl_jobs_latency_seconds", "job latency from submission to done",
                                 buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600), registry=self.registry)
        self._watermark = 0.0

    def update(self, store: JobStore, stats: Any) -> None:
        self.replicas.set(stats.replicas)
        self.target.set(stats.target)
        self.queue_depth.set(stats.queued)
        self.in_flight.set(stats.in_flight)
        for _id, latency, finished_at in store.finished_since(self._watermark):
            self.latency.observe(latency)
            self._watermark = max(self._watermark, finished_at)


def create_app(store: JobStore, broker: Broker, pool: Any, autoscaler: Any, metrics: JobsMetrics | None = None,
               api_keys: Sequence[str] = (), limiter: RateLimiter | None = None):
    """The app; with `api_keys`, every route needs one of them and jobs are visible to their submitter only; with
    `limiter`, each client address is paced by it, ahead of the key check (None: no limit)."""
    app = FastAPI(title="jointrl jobs", docs_url=None, redoc_url=None)
    metrics = metrics or JobsMetrics()
    keyed = bool(api_keys)

    def owner_of(request: Request) -> str | None:
        return request.scope.get("state", {}).get("owner")

    def visible(job_id: str, request: Request) -> JobView:
        """The job if the caller may see it; 404 alike for a missing job and someone else's."""
        view = store.get(job_id) if len(job_id) <= 64 else None
        if view is None or (keyed and view.owner != owner_of(request)):
            raise HTTPException(status_code=404, detail=f"no job {short(job_id)}")
        return view

    def _env_known(env_id: str) -> None:
        from envs.registry import RegistryError, spec

        try:
            spec(env_id)
        except RegistryError as e:
            raise ConfigError(str(e)) from e

    def _discover() -> None:
        from envs.registry import list_envs

        list_envs()

    # the first lookup imports every environment plug-in (seconds): start it now, off the event loop
    threading.Thread(target=_discover, name="env-discovery", daemon=True).start()

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "counts": store.counts()}

    @app.post("/v1/jobs")
    async def submit(request: Request) -> JSONResponse:
        try:
            body = await read_json(request, MAX_BODY_BYTES)
        except BodyError as e:
            raise HTTPException(status_code=e.status, detail=e.detail) from None
        try:
            spec = JobSpec.from_json(body)
            await asyncio.to_thread(_env_known, spec.env)
        except (ConfigError, TypeError) as e:
            raise HTTPException(status_code=422, detail=str(e)[:2000]) from None
        job_id = store.create_job(spec, owner_of(request))  # first the record, then the entry: a crash in between is repaired at start-up
        store.set_entry(job_id, broker.enqueue(job_id))
        return JSONResponse({"id": job_id}, status_code=201)

    @app.get("/v1/jobs/workers")
    def workers() -> dict[str, Any]:
        return {"workers": [asdict(w) for w in pool.workers()]}

    @app.get("/v1/jobs/{job_id}")
    def status(job_id: str, request: Request) -> dict[str, Any]:
        return visible(job_id, request).to_json()

    @app.delete("/v1/jobs/{job_id}")
    def cancel(job_id: str, request: Request) -> dict[str, Any]:
        visible(job_id, request)
        cancelled = store.cancel(job_id)  # a worker running it sees this on its next heartbeat and stops
        return {"id": job_id, "cancelled": cancelled, "status": store.get(job_id).status}  # type: ignore[union-attr]

    @app.get("/v1/jobs/{job_id}/events")
    async def events(job_id: str, request: Request, after: str | None = None) -> StreamingResponse:
        visible(job_id, request)
        start = _seq(after, "after")
        if start is None:
            start = _seq(request.headers.get("last-event-id"), "the Last-Event-ID header") or 0

        async def stream() -> AsyncIterator[bytes]:
            seq = start
            while True:
                # status first, then events: a job seen final has all its events committed (same transaction)
                view = await asyncio.to_thread(store.get, job_id)
                evs = await asyncio.to_thread(store.events, job_id, seq)
                for ev in evs:
                    seq = ev.seq
                    yield f"id: {ev.seq}\nevent: {ev.kind}\ndata: {json.dumps(ev.to_json())}\n\n".encode()
                if view is None or view.status in FINAL_STATUSES:
                    return
                if await request.is_disconnected():
                    return
                await asyncio.sleep(EVENT_POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics.update(store, autoscaler.stats)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(KeyGate, keys=tuple(api_keys))
    if limiter is not None and limiter.enabled:
        app.add_middleware(RateGate, limiter=limiter)  # added last: the outermost, so it answers before KeyGate
    return app
