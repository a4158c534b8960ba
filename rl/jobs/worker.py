"""An agent worker: a process that takes jobs from the broker and runs each as one multi-turn episode.

`python -m rl.jobs.worker --name NAME --policy-url URL --config JSON` (the worker pool starts these).
Each job is task `index` of an environment's split, run by the project's own agent loop
(`rl.rollout.agent_loop.run_episode`) in the environment's sandbox against the served policy
(`rl.jobs.policy.RemotePolicy`), so the recorded episode is token-level, exactly as training
records it. The environment is wrapped so that every reset, turn and grade is written to the
database as an event while the episode runs.

Per entry: a job already final is acknowledged and skipped (a duplicate delivery); a job that has
used up `max_attempts` (its earlier attempts raised, or died with their worker) goes to the
dead-letter stream; otherwise the attempt is counted, the episode runs while a heartbeat thread
keeps the entry ours and watches for cancellation, and the result is stored before the entry is
acknowledged. An attempt that raises is re-enqueued at once (or dead-lettered on the last attempt).
Two failures are final at once, since another attempt would fail the same way at the same cost: a
task index past the split (`TaskIndexError`), and an attempt past `job_timeout_s` (`JobTimeout`).

The time limit frees the worker whatever the job does: at the deadline the watcher cancels the
episode; an episode stuck in code that cannot be cancelled (a long synchronous computation) is
failed by the watcher itself after `CANCEL_GRACE_S`, and the worker process exits (`EXIT_STUCK`) so
the pool starts a fresh replica in its place.

Task sets come from the environments' on-disk cache (`envs.tasks`, as training reads them), so a
slow generator runs once per machine, not once per worker process.

SIGTERM drains: the worker finishes the job in hand, then exits (the autoscaler's scale-down).

What this module does not do: decide how many workers run (rl/jobs/pool.py) or serve HTTP.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from jointrl.records import Message, Task
from rl.jobs.broker import Broker, Delivery
from rl.jobs.records import FINAL_STATUSES, MAX_MODEL_LEN, JobResult, JobSpec, JobsConfig
from rl.jobs.store import JobStore, _msg_json, open_store
from rl.log import get_logger, setup_logging

log = get_logger("jobs.worker")


CANCEL_GRACE_S = 5.0  # after the deadline, how long a cancelled episode may take to stop before the worker exits
EXIT_STUCK = 75  # the exit code of a worker that left a job stuck past its time limit


class TaskIndexError(IndexError):
    """The job names a task past the end of its split: no attempt can succeed."""


class JobTimeout(Exception):
    """The attempt ran past `job_timeout_s`."""


@functools.lru_cache(maxsize=16)
def _split_tasks(env_id: str, split: str, seed: int) -> tuple[Task, ...]:
    import envs

    return tuple(Task.from_row(r) for r in envs.tasks(env_id, split, seed=seed))


TASK_SEED = 0  # the seed every split is generated with (envs.registry.tasks, as training uses it)


def task_for(spec: JobSpec) -> Task:
    """The task a job names; TaskIndexError when the split has no task `index`."""
    tasks = _split_tasks(spec.env, spec.split, TASK_SEED)
    if spec.index >= len(tasks):
        raise TaskIndexError(f"{spec.env} split {spec.split!r} has {len(tasks)} tasks; job index {spec.index} is out of range")
    return replace(tasks[spec.index], thinking=spec.thinking)  # type: ignore[arg-type]


class RecordingEnv:
    """An `Env` that writes an event for each reset, step and grade of the env it wraps (everything else passes through)."""

    def __init__(self, env: Any, emit: Callable[[str, Mapping[str, Any]], None]) -> None:
        self._env = env
        self._emit = emit
        self._turn = 0

    def __getattr__(self, name: str) -> Any:  # domain, rubric, tool schemas: the agent loop may read them
        return getattr(self._env, name)

    async def reset(self, task: Task):
        messages, tools = await self._env.reset(task)
        self._emit("reset", {"task_id": task.id, "messages": [_msg_json(m) for m in messages], "tools": [t.get("function", t).get("name") for t in tools]})
        return messages, tools

    async def step(self, assistant: Message, **kw: Any):
        res = await self._env.step(assistant, **kw)
        self._turn += 1
        self._emit("turn", {"turn": self._turn, "assistant": _msg_json(assistant), "observations": [_msg_json(m) for m in res.messages],
                            "terminated": res.terminated, "truncated": res.truncated})
        return res

    async def grade(self):
        g = await self._env.grade()
        self._emit("graded", {"reward": g.reward, "error": g.error, "metrics": dict(g.metrics)})
        return g

    def close(self) -> None:
        self._env.close()


class EpisodeRunner:
    """Runs one job's episode against the policy; shared by the worker and the benchmark's direct baseline."""

    def __init__(self, cfg: JobsConfig, policy_url: str) -> None:
        from model import chat
        from rl.jobs.policy import RemotePolicy
        from rl.rollout.agent_loop import LoopSettings

        self.chat = chat
        self.tok = chat.load_tokenizer()
        self.policy = RemotePolicy(policy_url)
        self.settings = LoopSettings(max_model_len=MAX_MODEL_LEN, max_new_tokens_per_turn=cfg.max_new_tokens_per_turn,
                                     max_turns=cfg.max_turns, end_token_id=chat.IM_END_ID)

    async def run(self, job_id: str, spec: JobSpec, emit: Callable[[str, Mapping[str, Any]], None]):
        import envs
        from rl.rollout.agent_loop import BatchingGenerator, derive_seed, run_episode

        task = task_for(spec)
        env = RecordingEnv(envs.make(spec.env), emit)
        gen = BatchingGenerator(self.policy.generate_batch)
        ep = await run_episode(env, task, gen, self.tok, self.chat, self.settings, group_id=f"job:{job_id}",
                               seed=derive_seed(TASK_SEED, spec.index))
        if ep.metrics.get("episode_error"):  # the agent loop turned an exception into an errored episode: a failed attempt
            raise RuntimeError(ep.grade_error or "the episode errored")
        return ep


class Worker:
    def __init__(self, name: str, cfg: JobsConfig, store: JobStore, broker: Broker, runner: EpisodeRunner) -> None:
        self.name = name
        self.cfg = cfg
        self.store = store
        self.broker = broker
        self.runner = runner
        self.draining = False
        self.jobs_done = 0

    def serve(self, max_jobs: int | None = None) -> None:
        """Take jobs until drained (SIGTERM) or `max_jobs` were handled."""
        handled = 0
        while not self.draining and (max_jobs is None or handled < max_jobs):
            d = self.broker.claim_stale(self.name, self.cfg.claim_timeout_s) or self.broker.read(self.name, block_ms=500)
            if d is None:
                continue
            self.handle(d)
            handled += 1
        self.broker.remove_consumer(self.name)

    def handle(self, d: Delivery) -> None:
        view = self.store.get(d.job_id)
        if view is None or view.status in FINAL_STATUSES:
            self.broker.ack(d.entry_id)  # unknown, or a duplicate delivery of a finished job: idempotent
            return
        if view.attempts >= self.cfg.max_attempts:  # the last attempt died with its worker
            error = view.error or f"attempt {view.attempts} did not finish (its worker died)"
            self._dead_letter(d, view.attempts, error)
            return
        attempt = self.store.start_attempt(d.job_id, self.name)
        if attempt is None:
            self.broker.ack(d.entry_id)
            return
        if d.claimed:
            self.store.add_event(d.job_id, attempt, "claimed", {"worker": self.name, "entry": d.entry_id})
        log.info("%s: job %s attempt %d", self.name, d.job_id, attempt)
        t0 = time.monotonic()
        try:
            ep = self._run_watched(d, view.spec, attempt)
        except asyncio.CancelledError:
            self.broker.ack(d.entry_id)  # DELETE /v1/jobs/{id}: the store already says cancelled
            return
        except (TaskIndexError, JobTimeout) as e:  # another attempt would fail the same way: final now
            log.warning("%s: job %s attempt %d failed for good: %s", self.name, d.job_id, attempt, e)
            self._dead_letter(d, attempt, f"{type(e).__name__}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - any failure of the attempt is recorded, never lost
            error = f"{type(e).__name__}: {e}"
            log.warning("%s: job %s attempt %d failed: %s", self.name, d.job_id, attempt, traceback.format_exc())
            if attempt >= self.cfg.max_attempts:
                self._dead_letter(d, attempt, error)
            else:
                self.store.fail_attempt(d.job_id, attempt, error, final=False)
                entry = self.broker.enqueue(d.job_id)  # a retry right away, not after a claim timeout
                self.store.set_entry(d.job_id, entry)
                self.broker.ack(d.entry_id)
            return
        result = JobResult(reward=float(ep.reward), turns=int(ep.num_turns), terminated=bool(ep.terminated), truncated=bool(ep.truncated),
                           grade_error=ep.grade_error, num_tokens=len(ep.token_ids), wall_s=time.monotonic() - t0, worker=self.name)
        self.store.complete(d.job_id, attempt, result, ep)  # False: another delivery finished it first; nothing changes
        self.broker.ack(d.entry_id)
        self.jobs_done += 1

    def _dead_letter(self, d: Delivery, attempts: int, error: str) -> None:
        # the event before the final status: an event stream that sees the job final has seen this event too
        self.store.add_event(d.job_id, attempts, "dead_letter", {"error": error, "attempts": attempts})
        self.store.fail_attempt(d.job_id, attempts, error, final=True)
        self.broker.dead_letter(d.entry_id, d.job_id, attempts, error)
        log.warning("%s: job %s dead-lettered after %d attempts: %s", self.name, d.job_id, attempts, error)

    def _run_watched(self, d: Delivery, spec: JobSpec, attempt: int):
        """Run the episode; a thread keeps the entry ours (heartbeat), cancels the episode if the job is cancelled,
        and enforces `job_timeout_s` (module docstring). Raises JobTimeout for an attempt past its limit."""
        stop = threading.Event()
        timed_out = threading.Event()
        loop = asyncio.new_event_loop()
        emit = lambda kind, data: self.store.add_event(d.job_id, attempt, kind, data)  # noqa: E731
        task = loop.create_task(self.runner.run(d.job_id, spec, emit))
        limit = self.cfg.job_timeout_s
        deadline = time.monotonic() + limit

        def stuck() -> None:
            """The episode ignored its cancellation: fail the job from here and replace this process."""
            error = (f"JobTimeout: the attempt ran past jobs.job_timeout_s={limit:g}s and did not stop within "
                     f"{CANCEL_GRACE_S:g}s of its cancellation; its worker {self.name} was replaced")
            log.error("%s: job %s: %s", self.name, d.job_id, error)
            self._dead_letter(d, attempt, error)
            os._exit(EXIT_STUCK)

        def watch() -> None:
            period = max(0.2, self.cfg.claim_timeout_s / 3)
            next_beat = time.monotonic() + period
            while not stop.wait(max(0.05, min(next_beat, deadline) - time.monotonic())):
                now = time.monotonic()
                if now >= deadline:
                    timed_out.set()
                    loop.call_soon_threadsafe(task.cancel)
                    if not stop.wait(CANCEL_GRACE_S):
                        stuck()
                    return
                if now < next_beat:
                    continue
                next_beat = now + period
                try:
                    if not self.broker.heartbeat(self.name, d.entry_id):
                        log.warning("%s: entry %s was claimed by another worker", self.name, d.entry_id)
                    v = self.store.get(d.job_id)
                    if v is not None and v.status == "cancelled":
                        loop.call_soon_threadsafe(task.cancel)
                        return
                except Exception:  # noqa: BLE001 - a missed heartbeat only risks a duplicate delivery
                    log.warning("%s: heartbeat failed: %s", self.name, traceback.format_exc())

        t = threading.Thread(target=watch, name="heartbeat", daemon=True)
        t.start()
        try:
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                if timed_out.is_set():
                    raise JobTimeout(f"the attempt ran past jobs.job_timeout_s={limit:g}s and was cancelled") from None
                raise
        finally:
            stop.set()
            t.join(timeout=5)
            loop.run_until_complete(self.runner.policy.aclose())
            rest = asyncio.all_tasks(loop)  # the BatchingGenerator's flusher loops forever: cancel it with the loop
            for t_ in rest:
                t_.cancel()
            if rest:
                loop.run_until_complete(asyncio.wait(rest))
            loop.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl.jobs.worker")
    p.add_argument("--name", required=True)
    p.add_argument("--policy-url", required=True)
    p.add_argument("--config", required=True, help="JobsConfig as JSON")
    args = p.parse_args(argv)
    setup_logging()
    cfg = JobsConfig.from_json(args.config)
    store = open_store(cfg.db_url)
    broker = Broker(cfg.redis_url, cfg.stream)
    worker = Worker(args.name, cfg, store, broker, EpisodeRunner(cfg, args.policy_url))

    def drain(_sig: int, _frame: Any) -> None:
        worker.draining = True

    signal.signal(signal.SIGTERM, drain)
    log.info("worker %s up", args.name)
    worker.serve()
    log.info("worker %s drained after %d jobs", args.name, worker.jobs_done)
    store.close()
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
