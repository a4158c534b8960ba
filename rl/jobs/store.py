"""The jobs database: jobs, their turn-by-turn events, results and token-level episodes, behind one interface.

`open_store(url)` returns a `JobStore`. `sqlite:///relative/path` and `sqlite:////absolute/path`
open SQLite (WAL mode, so the API server and every worker process read and write the same file;
a busy timeout instead of lock errors). Every write is one transaction, committed before the call
returns: a worker or server that dies loses nothing it was told was written.

Schema migrations are versioned: `MIGRATIONS[i]` takes the schema from version i to i+1, and the
version lives in `PRAGMA user_version`, so opening an old database upgrades it in place and opening a
database from a newer build is refused (its schema is unknown here).

Completion is idempotent: `complete()` flips a job to `done` only if it is not final yet, in the
same transaction that stores its result, episode and `done` event; a second completion (the same
entry delivered twice) changes nothing and returns False.

What this module does not do: Postgres. A `postgresql://` URL is refused with a ConfigError: no
Postgres server or driver runs on the machines this is tested on, and an untested backend would only
pretend to work. A Postgres backend implements `JobStore` with the same SQL (see docs/jobs.md).
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from jointrl.records import Message
from rl.config import ConfigError
from rl.jobs.records import FINAL_STATUSES, JobEvent, JobResult, JobSpec, JobView
from rl.types import Episode


class JobStore(ABC):
    """What the API server and the workers need from a database."""

    @abstractmethod
    def create_job(self, spec: JobSpec, owner: str | None = None) -> str:
        """Record a queued job; `owner` is the submitting key's id (rl/jobs/guard.py: key_id), None without keys."""

    @abstractmethod
    def get(self, job_id: str) -> JobView | None: ...

    @abstractmethod
    def set_entry(self, job_id: str, entry_id: str) -> None:
        """Record the broker entry that carries the job (to re-enqueue it if the broker lost it)."""

    @abstractmethod
    def start_attempt(self, job_id: str, worker: str) -> int | None:
        """Mark the job running and count one more attempt; its number, or None if the job is final."""

    @abstractmethod
    def add_event(self, job_id: str, attempt: int, kind: str, data: Mapping[str, Any]) -> int: ...

    @abstractmethod
    def events(self, job_id: str, after_seq: int = 0) -> list[JobEvent]: ...

    @abstractmethod
    def complete(self, job_id: str, attempt: int, result: JobResult, episode: Episode) -> bool:
        """Store the result and episode and mark the job done; False (and no change) if it already was final."""

    @abstractmethod
    def fail_attempt(self, job_id: str, attempt: int, error: str, final: bool) -> bool:
        """Record a failed attempt: back to `queued` for a retry, or `failed` when `final`. False if already final."""

    @abstractmethod
    def cancel(self, job_id: str) -> bool: ...

    @abstractmethod
    def unfinished(self) -> list[tuple[str, str | None]]:
        """(job id, broker entry id) of every job that is neither done, failed nor cancelled."""

    @abstractmethod
    def counts(self) -> dict[str, int]: ...

    @abstractmethod
    def finished_since(self, t: float) -> list[tuple[str, float, float]]:
        """(job id, latency from creation to finish, finish time) of jobs done after time `t`."""

    @abstractmethod
    def episodes(self, job_ids: Sequence[str] | None = None) -> list[Episode]:
        """Token-level episodes of done jobs (all of them when `job_ids` is None), to feed training."""

    @abstractmethod
    def close(self) -> None: ...


# Each migration moves the schema one version up; never edit a released one, append a new one.
MIGRATIONS: tuple[str, ...] = (
    # 0 -> 1: jobs and events
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        result TEXT, error TEXT, entry_id TEXT, worker TEXT,
        created_at REAL NOT NULL, started_at REAL, finished_at REAL);
    CREATE INDEX jobs_status ON jobs(status);
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL REFERENCES jobs(id), attempt INTEGER NOT NULL,
        kind TEXT NOT NULL, data TEXT NOT NULL, at REAL NOT NULL);
    CREATE INDEX events_job ON events(job_id, seq);
    """,
    # 1 -> 2: token-level episodes of done jobs (one per job: the completing attempt's)
    """
    CREATE TABLE episodes (
        job_id TEXT PRIMARY KEY REFERENCES jobs(id), attempt INTEGER NOT NULL, task_id TEXT NOT NULL, domain TEXT NOT NULL,
        token_ids TEXT NOT NULL, loss_mask TEXT NOT NULL, rollout_logprobs TEXT NOT NULL, messages TEXT NOT NULL,
        reward REAL NOT NULL, metrics TEXT NOT NULL, terminated INTEGER NOT NULL, truncated INTEGER NOT NULL,
        num_turns INTEGER NOT NULL, policy_version INTEGER NOT NULL, grade_error TEXT, wall_s REAL NOT NULL);
    CREATE INDEX jobs_finished ON jobs(finished_at);
    """,
    # 2 -> 3: the owner of each job (a hash of the API key that submitted it; NULL when the server had no keys)
    """
    ALTER TABLE jobs ADD COLUMN owner TEXT;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


def open_store(url: str) -> JobStore:
    """A store for `url` (`sqlite:///path`); see the module docstring for what is refused."""
    if url.startswith("sqlite:///"):
        return SqliteStore(url[len("sqlite:///"):])
    if url.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"jobs.db_url {url!r}: the Postgres backend is not built (only SQLite is implemented and tested); "
                          "use sqlite:///PATH")
    raise ConfigError(f"jobs.db_url must be sqlite:///PATH, got {url!r}")


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the schema up to SCHEMA_VERSION; the version it found."""
    found = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if found > SCHEMA_VERSION:
        raise ConfigError(f"the jobs database has schema version {found}, newer than this build's {SCHEMA_VERSION}")
    for v in range(found, SCHEMA_VERSION):
        # executescript commits first; the version bump goes in the same script so a crash leaves v or v+1, never half
        conn.executescript(f"BEGIN;\n{MIGRATIONS[v]}\nPRAGMA user_version = {v + 1};\nCOMMIT;")
    return found


def _msg_json(m: Message) -> dict[str, Any]:
    d = m.to_openai()
    if m.reasoning:
        d["reasoning"] = m.reasoning
    return d


class SqliteStore(JobStore):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()  # one connection shared by the API's threads
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        self._conn.execute("PRAGMA busy_timeout=30000")
        with self._lock:
            self.migrated_from = migrate(self._conn)

    # -- helpers
    def _tx(self, fn):  # noqa: ANN001 - a closure over the connection
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")  # take the write lock up front: no upgrade deadlocks between processes
            try:
                out = fn(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return out

    @staticmethod
    def _event(conn: sqlite3.Connection, job_id: str, attempt: int, kind: str, data: Mapping[str, Any]) -> int:
        cur = conn.execute("INSERT INTO events(job_id, attempt, kind, data, at) VALUES (?,?,?,?,?)",
                           (job_id, attempt, kind, json.dumps(dict(data)), time.time()))
        return int(cur.lastrowid)

    # -- JobStore
    def create_job(self, spec: JobSpec, owner: str | None = None) -> str:
        job_id = uuid.uuid4().hex  # 128 random bits: ids are not guessable (ownership is checked as well)

        def tx(c: sqlite3.Connection) -> str:
            c.execute("INSERT INTO jobs(id, spec, status, created_at, owner) VALUES (?,?,?,?,?)",
                      (job_id, spec.to_json(), "queued", time.time(), owner))
            self._event(c, job_id, 0, "queued", {})
            return job_id

        return self._tx(tx)

    def get(self, job_id: str) -> JobView | None:
        with self._lock:
            row = self._conn.execute("SELECT id, spec, status, attempts, result, error, created_at, started_at, finished_at, owner "
                                     "FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            return None
        result = None if row[4] is None else JobResult(**json.loads(row[4]))
        return JobView(id=row[0], spec=JobSpec(**json.loads(row[1])), status=row[2], attempts=int(row[3]), result=result,
                       error=row[5], created_at=row[6], started_at=row[7], finished_at=row[8], owner=row[9])

    def set_entry(self, job_id: str, entry_id: str) -> None:
        self._tx(lambda c: c.execute("UPDATE jobs SET entry_id=? WHERE id=?", (entry_id, job_id)))

    def start_attempt(self, job_id: str, worker: str) -> int | None:
        def tx(c: sqlite3.Connection) -> int | None:
            row = c.execute("SELECT status, attempts FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None or row[0] in FINAL_STATUSES:
                return None
            attempt = int(row[1]) + 1
            c.execute("UPDATE jobs SET status='running', attempts=?, worker=?, started_at=? WHERE id=?",
                      (attempt, worker, time.time(), job_id))
            self._event(c, job_id, attempt, "started", {"worker": worker})
            return attempt

        return self._tx(tx)

    def add_event(self, job_id: str, attempt: int, kind: str, data: Mapping[str, Any]) -> int:
        return self._tx(lambda c: self._event(c, job_id, attempt, kind, data))

    def events(self, job_id: str, after_seq: int = 0) -> list[JobEvent]:
        with self._lock:
            rows = self._conn.execute("SELECT seq, job_id, attempt, kind, data, at FROM events WHERE job_id=? AND seq>? ORDER BY seq",
                                      (job_id, after_seq)).fetchall()
        return [JobEvent(seq=r[0], job_id=r[1], attempt=r[2], kind=r[3], data=json.loads(r[4]), at=r[5]) for r in rows]

    def complete(self, job_id: str, attempt: int, result: JobResult, episode: Episode) -> bool:
        def tx(c: sqlite3.Connection) -> bool:
            cur = c.execute(f"UPDATE jobs SET status='done', result=?, error=NULL, finished_at=? WHERE id=? "
                            f"AND status NOT IN ({','.join('?' * len(FINAL_STATUSES))})",
                            (json.dumps(asdict(result)), time.time(), job_id, *sorted(FINAL_STATUSES)))
            if cur.rowcount != 1:
                return False
            e = episode
            c.execute("INSERT INTO episodes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                      (job_id, attempt, e.task_id, e.domain, json.dumps(list(e.token_ids)), json.dumps(list(e.loss_mask)),
                       json.dumps(list(e.rollout_logprobs)), json.dumps([_msg_json(m) for m in e.messages]), float(e.reward),
                       json.dumps(dict(e.metrics)), int(e.terminated), int(e.truncated), int(e.num_turns),
                       int(e.policy_version), e.grade_error, float(e.wall_s)))
            self._event(c, job_id, attempt, "done", {"reward": result.reward, "turns": result.turns})
            return True

        return self._tx(tx)

    def fail_attempt(self, job_id: str, attempt: int, error: str, final: bool) -> bool:
        def tx(c: sqlite3.Connection) -> bool:
            cur = c.execute(f"UPDATE jobs SET status=?, error=?, finished_at=? WHERE id=? "
                            f"AND status NOT IN ({','.join('?' * len(FINAL_STATUSES))})",
                            ("failed" if final else "queued", error, time.time() if final else None, job_id, *sorted(FINAL_STATUSES)))
            if cur.rowcount != 1:
                return False
            self._event(c, job_id, attempt, "failed" if final else "retry", {"error": error})
            return True

        return self._tx(tx)

    def cancel(self, job_id: str) -> bool:
        def tx(c: sqlite3.Connection) -> bool:
            cur = c.execute(f"UPDATE jobs SET status='cancelled', finished_at=? WHERE id=? "
                            f"AND status NOT IN ({','.join('?' * len(FINAL_STATUSES))})", (time.time(), job_id, *sorted(FINAL_STATUSES)))
            if cur.rowcount == 1:
                self._event(c, job_id, 0, "cancelled", {})
            return cur.rowcount == 1

        return self._tx(tx)

    def unfinished(self) -> list[tuple[str, str | None]]:
        with self._lock:
            rows = self._conn.execute(f"SELECT id, entry_id FROM jobs WHERE status NOT IN ({','.join('?' * len(FINAL_STATUSES))}) "
                                      "ORDER BY created_at", tuple(sorted(FINAL_STATUSES))).fetchall()
        return [(r[0], r[1]) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._conn.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def finished_since(self, t: float) -> list[tuple[str, float, float]]:
        with self._lock:
            rows = self._conn.execute("SELECT id, finished_at - created_at, finished_at FROM jobs WHERE finished_at > ? "
                                      "AND status='done' ORDER BY finished_at", (t,)).fetchall()
        return [(r[0], float(r[1]), float(r[2])) for r in rows]

    def episodes(self, job_ids: Sequence[str] | None = None) -> list[Episode]:
        q = ("SELECT job_id, task_id, domain, token_ids, loss_mask, rollout_logprobs, messages, reward, metrics, terminated, "
             "truncated, num_turns, policy_version, grade_error, wall_s FROM episodes")
        with self._lock:
            if job_ids is None:
                rows = self._conn.execute(q + " ORDER BY rowid").fetchall()
            else:
                rows = [r for j in job_ids for r in self._conn.execute(q + " WHERE job_id=?", (j,)).fetchall()]
        return [Episode(task_id=r[1], domain=r[2], group_id=f"job:{r[0]}", token_ids=tuple(json.loads(r[3])),
                        loss_mask=tuple(json.loads(r[4])), rollout_logprobs=tuple(json.loads(r[5])),
                        messages=tuple(Message.from_openai(m) for m in json.loads(r[6])), reward=r[7], metrics=json.loads(r[8]),
                        terminated=bool(r[9]), truncated=bool(r[10]), num_turns=r[11], policy_version=r[12], grade_error=r[13],
                        wall_s=r[14]) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
