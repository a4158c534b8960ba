"""The jobs HTTP API (FastAPI) and its Prometheus metrics.

Routes: `POST /v1/jobs` (a `JobSpec` body -> `{"id"}`), `GET /v1/jobs/{id}` (status, attempts,
result), `GET /v1/jobs/{id}/events` (Server-Sent Events, one per stored event; `Last-Event-ID` or
`?after=SEQ` resumes, so a client that lost the server reconnects without missing or repeating
events), `DELETE /v1/jobs/{id}` (cancel), `GET /v1/jobs/workers` (replica names and pids),
`GET /metrics` (replicas, queue depth, in-flight jobs, job latency), `GET /health`.

The database is the source of truth for every answer, so any server process over the same database
answers the same (a restarted server included). The event stream polls the database; it ends after
the job's final event.

What this module does not do: run jobs or scale workers (it reads the pool and autoscaler it is given).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rl.config import ConfigError
from rl.jobs.broker import Broker
from rl.jobs.records import FINAL_STATUSES, JobSpec
from rl.jobs.store import JobStore

EVENT_POLL_S = 0.2
FINAL_EVENTS = frozenset({"done", "failed", "cancelled", "dead_letter"})


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


def create_app(store: JobStore, broker: Broker, pool: Any, autoscaler: Any, metrics: JobsMetrics | None = None):
    app = FastAPI(title="jointrl jobs")
    metrics = metrics or JobsMetrics()

    def _env_known(env_id: str) -> None:
        from envs.registry import RegistryError, spec

        try:
            spec(env_id)
        except RegistryError as e:
            raise ConfigError(str(e)) from e

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "counts": store.counts()}

    @app.post("/v1/jobs")
    async def submit(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise HTTPException(status_code=400, detail=f"body is not JSON: {e}") from e
        try:
            spec = JobSpec.from_json(body)
            _env_known(spec.env)
        except (ConfigError, TypeError) as e:
            raise HTTPException(status_code=422, detail=str(e)) from e
        job_id = store.create_job(spec)  # first the record, then the entry: a crash in between is repaired at start-up
        store.set_entry(job_id, broker.enqueue(job_id))
        return JSONResponse({"id": job_id}, status_code=201)

    @app.get("/v1/jobs/workers")
    def workers() -> dict[str, Any]:
        return {"workers": [asdict(w) for w in pool.workers()]}

    @app.get("/v1/jobs/{job_id}")
    def status(job_id: str) -> dict[str, Any]:
        view = store.get(job_id)
        if view is None:
            raise HTTPException(status_code=404, detail=f"no job {job_id!r}")
        return view.to_json()

    @app.delete("/v1/jobs/{job_id}")
    def cancel(job_id: str) -> dict[str, Any]:
        view = store.get(job_id)
        if view is None:
            raise HTTPException(status_code=404, detail=f"no job {job_id!r}")
        cancelled = store.cancel(job_id)  # a worker running it sees this on its next heartbeat and stops
        return {"id": job_id, "cancelled": cancelled, "status": store.get(job_id).status}  # type: ignore[union-attr]

    @app.get("/v1/jobs/{job_id}/events")
    async def events(job_id: str, request: Request, after: int | None = None) -> StreamingResponse:
        if store.get(job_id) is None:
            raise HTTPException(status_code=404, detail=f"no job {job_id!r}")
        last = request.headers.get("last-event-id")
        start = after if after is not None else (int(last) if last and last.isdigit() else 0)

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

    return app
