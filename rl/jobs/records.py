"""Typed records of the jobs service: what a client submits, what the store keeps, and the service config.

`JobSpec` is the body of `POST /v1/jobs`; `JobView` is what `GET /v1/jobs/{id}` returns; `JobEvent`
is one turn-by-turn event (also the SSE payload). `JobsConfig` holds every setting of
`jointrl jobs serve`, with one default each, validated up front (`ConfigError` naming the key).

What this module does not do: talk to Redis, SQLite or HTTP.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Mapping

from rl.config import ConfigError
from rl.rollout.tiers import TIERS  # noqa: F401 - re-exported for rl/jobs/cli.py

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
STATUSES: tuple[str, ...] = ("queued", "running", "done", "failed", "cancelled")
FINAL_STATUSES: frozenset[str] = frozenset({"done", "failed", "cancelled"})
SPLITS: tuple[str, ...] = ("train", "heldout")
MAX_MODEL_LEN = 2048  # the policy engine's context, and the agent loop's (the shipped tiny/small models' default)
MAX_INDEX = 2**31 - 1  # no split is this large; bounds what the database stores and compares
MAX_ENV_ID_CHARS = 200


@dataclass(frozen=True)
class JobSpec:
    """One agent job: task `index` of `env`'s `split` (the split generated with seed 0, as training and
    evaluation generate it), run at thinking tier `thinking`."""

    env: str
    split: str = "train"
    index: int = 0
    thinking: str = "low"

    def __post_init__(self) -> None:
        from rl.jobs.guard import short

        if not isinstance(self.env, str) or not self.env or len(self.env) > MAX_ENV_ID_CHARS:
            raise ConfigError(f"job.env must be an environment id (at most {MAX_ENV_ID_CHARS} characters), got {short(self.env)}")
        if not isinstance(self.split, str) or self.split not in SPLITS:
            raise ConfigError(f"job.split must be one of {list(SPLITS)}, got {short(self.split)}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or not 0 <= self.index <= MAX_INDEX:
            raise ConfigError(f"job.index must be an integer in [0, {MAX_INDEX}], got {short(self.index)}")
        if not isinstance(self.thinking, str) or self.thinking not in TIERS:
            raise ConfigError(f"job.thinking must be one of {list(TIERS)}, got {short(self.thinking)}")

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "JobSpec":
        if not isinstance(d, Mapping):
            raise ConfigError(f"a job must be a JSON object, got {type(d).__name__}")
        allowed = {f.name for f in fields(JobSpec)}
        extra = sorted(set(d) - allowed)
        if extra:
            raise ConfigError(f"unknown job field(s) {extra}; allowed: {sorted(allowed)}")
        if "env" not in d:
            raise ConfigError("job.env is required")
        return JobSpec(**dict(d))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class JobResult:
    """A finished episode's outcome (the token-level episode itself is in the store's episodes table)."""

    reward: float
    turns: int
    terminated: bool
    truncated: bool
    grade_error: str | None
    num_tokens: int
    wall_s: float
    worker: str


@dataclass(frozen=True)
class JobView:
    """`GET /v1/jobs/{id}`."""

    id: str
    spec: JobSpec
    status: str
    attempts: int
    result: JobResult | None
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    owner: str | None = None  # guard.key_id of the API key that submitted it; None without keys (not sent to clients)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("owner")
        d["result"] = None if self.result is None else asdict(self.result)
        return d


@dataclass(frozen=True)
class JobEvent:
    """One event of a job: `seq` is global and increasing (SSE clients resume after the last seq they saw)."""

    seq: int
    job_id: str
    attempt: int
    kind: str  # queued | started | reset | turn | graded | done | failed | retry | cancelled | dead_letter
    data: Mapping[str, Any]
    at: float

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "job_id": self.job_id, "attempt": self.attempt, "kind": self.kind,
                "data": dict(self.data), "at": self.at}


@dataclass(frozen=True)
class JobsConfig:
    """Settings of `jointrl jobs serve` (each is a CLI flag of that command; see docs/jobs.md)."""

    redis_url: str = "redis://127.0.0.1:6390/0"  # started by the server when nothing answers there
    db_url: str = "sqlite:///runs/jobs/jobs.sqlite"
    stream: str = "jointrl:jobs"  # the jobs stream; the dead-letter stream is f"{stream}:dead"
    min_workers: int = 1
    max_workers: int = 1  # 0: API only; jobs wait in the stream for workers of another server or a later one
    workers: int = 1  # replicas at start, clamped to [min_workers, max_workers]
    claim_timeout_s: float = 30.0  # an entry pending this long without a heartbeat is claimed by another worker
    max_attempts: int = 3  # a job that failed this many attempts goes to the dead-letter stream
    jobs_per_worker: float = 2.0  # autoscaler target: (queued + in flight) per replica
    scale_down_delay_s: float = 5.0  # the target must stay below the replica count this long before a scale-down
    max_turns: int | None = None  # None: the task's own limit
    max_new_tokens_per_turn: int = 256
    policy_url: str | None = None  # an already-running policy server; None: the server starts one for MODEL
    # wall-clock limit of one attempt: past it the attempt is cancelled (or its worker replaced when the
    # job is stuck in code that cannot be cancelled) and the job fails for good, freeing the worker
    job_timeout_s: float = 900.0
    # the per-client rate limit of the jobs API (rl/ratelimit.py: a token bucket per client address; past it
    # 429 with Retry-After, before the key check and the body): the rate one address may sustain, 0: no limit
    rate_limit_per_s: float = 100.0
    rate_limit_burst: int = 512  # requests one address may send at once before the rate applies (a batch of submissions)

    def __post_init__(self) -> None:
        for key in ("min_workers", "max_workers", "workers", "max_attempts", "max_new_tokens_per_turn"):
            v = getattr(self, key)
            low = 0 if key.endswith("workers") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"jobs.{key} must be an integer >= {low}, got {v!r}")
        if self.max_workers < self.min_workers:
            raise ConfigError(f"jobs.max_workers ({self.max_workers}) must be >= jobs.min_workers ({self.min_workers})")
        for key in ("claim_timeout_s", "jobs_per_worker", "job_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"jobs.{key} must be > 0, got {getattr(self, key)!r}")
        if self.scale_down_delay_s < 0:
            raise ConfigError(f"jobs.scale_down_delay_s must be >= 0, got {self.scale_down_delay_s!r}")
        if self.max_turns is not None and (not isinstance(self.max_turns, int) or self.max_turns < 1):
            raise ConfigError(f"jobs.max_turns must be None or an integer >= 1, got {self.max_turns!r}")
        r = self.rate_limit_per_s
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r >= 0):
            raise ConfigError(f"jobs.rate_limit_per_s (--rate-limit-per-s) must be a finite number >= 0 (0: no limit), got {r!r}")
        b = self.rate_limit_burst
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError(f"jobs.rate_limit_burst (--rate-limit-burst) must be an integer >= 1, got {b!r}")
        if not self.redis_url.startswith("redis://"):
            raise ConfigError(f"jobs.redis_url must be a redis:// URL, got {self.redis_url!r}")

    @property
    def dead_stream(self) -> str:
        return f"{self.stream}:dead"

    @property
    def initial_workers(self) -> int:
        return max(self.min_workers, min(self.max_workers, self.workers))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "JobsConfig":
        return JobsConfig(**json.loads(text))


@dataclass(frozen=True)
class WorkerInfo:
    """One agent-worker replica (`GET /v1/jobs/workers`)."""

    name: str
    pid: int
    state: str  # running | draining
    started_at: float


@dataclass
class PoolStats:
    """What the autoscaler read and decided in one tick (also exported on /metrics)."""

    queued: int = 0
    in_flight: int = 0
    replicas: int = 0
    target: int = 0
    history: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas) after each change
