"""Typed records that cross component boundaries in the RL loop: episodes, groups, step metrics, and the
statistics the driver reads back from its parts (RolloutStats, TrainResult, SftStepResult, SyncStats,
GapStats).

Data only. Each statistic is a field that names its metric (`stat(name, reduce)`); `as_metrics()` turns
a record into `name -> value` in that one place, so the driver reads fields, never metric keys. A
trainer field also declares how the ranks' values combine (`Reduce`), read by rl/trainer/group.py.
Producers: the agent loop (Episode), the driver (RolloutGroup, StepMetrics). Consumers:
the trainer (which packs episodes into its own tensor batch, `rl/trainer/batch.py: TrainBatch`),
the metrics logger and the report. Records shared with environments (Message, Task, ...) live in
`jointrl.records`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from jointrl.records import Message


@dataclass(frozen=True)
class TokenImage:
    """An image (encoded bytes, PNG / JPEG) feeding tokens [start, start + length) of a token sequence: one
    `<|image|>` placeholder per patch (model/vision.py)."""

    data: bytes
    start: int
    length: int


@dataclass(frozen=True)
class Segment:
    """One context of an episode whose history was compacted (rl/rollout/context.py): the tokens the engine
    was given and generated while that context lasted, with the same per-token fields as `Episode`.

    token_versions: the policy version that generated each token (0 off the loss mask); () = every
    generated token came from the episode's `policy_version`.
    """

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    routed_experts: object | None = None  # numpy int array [T, L, k] or None
    images: tuple[TokenImage, ...] = ()
    token_versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Episode:
    """One finished multi-turn episode, token-in / token-out.

    token_ids: the whole sequence (prompt + every turn), built by appending only.
    loss_mask: 1 exactly on tokens the policy generated; 0 on prompt, template and tool-output tokens.
    rollout_logprobs: the engine's logprob of each token where loss_mask == 1, else 0.0.
    routed_experts: optional [len(token_ids), n_moe_layers, top_k] expert ids reported by the engine (R3).
    images: the images the policy saw, in order, each with the placeholder span it feeds (loss mask 0 there).
    segments: the earlier contexts of an episode whose history was compacted, oldest first; the fields
    above are its last context. Each is trained as a row of its own with the episode's reward and group.
    token_versions: the policy version that generated each token of the last context (0 off the loss mask;
    () = all from `policy_version`); a partial rollout continued under newer weights mixes versions.
    """

    task_id: str
    domain: str
    group_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    messages: tuple[Message, ...]
    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    terminated: bool = False
    truncated: bool = False
    num_turns: int = 0
    policy_version: int = 0
    grade_error: str | None = None
    routed_experts: object | None = None  # numpy int array [T, L, k] or None
    wall_s: float = 0.0
    images: tuple[TokenImage, ...] = ()
    segments: tuple[Segment, ...] = ()
    token_versions: tuple[int, ...] = ()


def segments_of(e: Episode) -> tuple[Segment, ...]:
    """Every context of `e` as a `Segment`, oldest first (one for an episode that was never compacted)."""
    last = Segment(token_ids=e.token_ids, loss_mask=e.loss_mask, rollout_logprobs=e.rollout_logprobs,
                   routed_experts=e.routed_experts, images=e.images, token_versions=e.token_versions)
    return (*e.segments, last)


@dataclass(frozen=True)
class RolloutGroup:
    """The G episodes of one task (the unit GRPO-style baselines are computed over)."""

    task_id: str
    domain: str
    episodes: tuple[Episode, ...]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]


@dataclass(frozen=True)
class StepMetrics:
    """What one driver step reports: flat `name -> value`, names like `reward/mean/swe`."""

    step: int
    values: Mapping[str, float]
    samples: Sequence[Mapping[str, str]] = ()


class Reduce(enum.Enum):
    """How one trainer statistic combines over the ranks of a step."""

    SUM = "sum"          # each rank counted its own share (tokens, sequences)
    MAX = "max"          # the slowest / largest rank (times, resident memory)
    RANK0 = "rank0"      # equal on every rank (grad norm after all-reduce, lr)
    SEQ_MEAN = "seq_mean"  # a per-sequence mean over the rank's share: weighted by its sequences


def stat(name: str, reduce: Reduce | None = None, default: Any = None) -> Any:
    """A statistic field: its metric name and (trainer statistics) how ranks combine it; None = not reported."""
    return field(default=default, metadata={"metric": name, "reduce": reduce})


def metrics_of(record: Any) -> dict[str, float]:
    """`metric name -> value` of every reported (not None) statistic field of `record`."""
    out: dict[str, float] = {}
    for f in fields(record):
        name = f.metadata.get("metric")
        v = getattr(record, f.name)
        if name is not None and v is not None:
            out[name] = float(v)
    return out


def metric_names(record: type, reduce: Reduce) -> frozenset[str]:
    """The metric names of `record`'s fields that ranks combine by `reduce` (e.g. the summed counts that a rank
    sharing another's rows must not count again)."""
    return frozenset(f.metadata["metric"] for f in fields(record) if f.metadata.get("reduce") is reduce and f.metadata.get("metric"))


@dataclass(frozen=True)
class RolloutStats:
    """One step's rollout statistics: the per-domain episode metrics (rl/observe/telemetry.py, partial
    rollouts' metrics) and what the driver adds (throughput, oversampled tasks)."""

    per_domain: Mapping[str, float] = field(default_factory=dict)
    episodes_per_s: float | None = stat("rollout/episodes_per_s")
    oversampled_tasks: int | None = stat("rollout/oversampled_tasks")

    def as_metrics(self) -> dict[str, float]:
        return {**self.per_domain, **metrics_of(self)}


@dataclass(frozen=True)
class TrainResult:
    """One RL update on the trainer ranks. The typed fields are the trainer's own bookkeeping, each with its
    rank reduction; `per_seq` holds the objective's and the telemetry's statistics (`pg/*`, `kl/*`,
    `mismatch/*`, `moe/*` ...), per-sequence means of each rank's share, combined weighted by its sequences."""

    seqs: float | None = stat("train/seqs", Reduce.SUM)
    tokens: float | None = stat("train/tokens", Reduce.SUM)
    forward_tokens: float | None = stat("train/forward_tokens", Reduce.SUM)
    micro_batches: float | None = stat("train/micro_batches", Reduce.SUM)
    step_s: float | None = stat("train/step_s", Reduce.MAX)
    busy_s: float | None = stat("train/busy_s", Reduce.MAX)
    old_logprob_s: float | None = stat("train/old_logprob_s", Reduce.MAX)
    ref_logprob_s: float | None = stat("train/ref_logprob_s", Reduce.MAX)
    rss_gb: float | None = stat("train/rss_gb", Reduce.MAX)  # the largest rank: the one Ray's OOM monitor takes first
    peak_rss_gb: float | None = stat("train/peak_rss_gb", Reduce.MAX)
    grad_norm: float | None = stat("train/grad_norm", Reduce.RANK0)
    lr: float | None = stat("train/lr", Reduce.RANK0)
    # the step's tokens over its slowest rank (set from the reduced tokens and step_s, not reduced itself)
    tokens_per_s: float | None = stat("train/tokens_per_s", Reduce.MAX)
    routing_replay: str | None = field(default=None, metadata={"reduce": Reduce.RANK0})  # "off" | "r2" | "r3"
    value_loss: float | None = stat("value/loss", Reduce.SUM)
    value_clipfrac: float | None = stat("value/clipfrac", Reduce.SEQ_MEAN)
    value_explained_var: float | None = stat("value/explained_var", Reduce.SEQ_MEAN)
    value_grad_norm: float | None = stat("value/grad_norm", Reduce.RANK0)
    value_step_s: float | None = stat("value/step_s", Reduce.MAX)
    world_size: int | None = stat("trainer/world_size")
    staleness: int | None = None  # policy versions between the oldest episode's generator and the trained weights
    per_seq: Mapping[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        out = {**self.per_seq, **metrics_of(self)}
        if self.routing_replay is not None:
            out["train/routing_replay_" + self.routing_replay] = 1.0
        if self.staleness is not None:
            out["policy/staleness"] = out["rollout/max_staleness_seen"] = float(self.staleness)
        return out


@dataclass(frozen=True)
class SftStepResult:
    """One supervised step on the trainer ranks."""

    nll: float | None = stat("sft/nll", Reduce.SEQ_MEAN)
    grad_norm: float | None = stat("sft/grad_norm", Reduce.RANK0)
    seqs: float | None = stat("train/seqs", Reduce.SUM)

    def as_metrics(self) -> dict[str, float]:
        return metrics_of(self)


@dataclass(frozen=True)
class SftStats:
    """A run of supervised steps (the warm start or the control arm): the last step and the totals."""

    last: SftStepResult | None = None
    trajectories: int | None = stat("sft/trajectories")
    data_reward: float | None = stat("sft/data_reward")
    steps: int = stat("sft/steps", default=0)
    seconds: float = stat("sft/seconds", default=0.0)

    def as_metrics(self) -> dict[str, float]:
        if self.trajectories is None:  # no SFT set: nothing ran
            return {}
        return {**(self.last.as_metrics() if self.last is not None else {}), **metrics_of(self)}


@dataclass(frozen=True)
class SyncStats:
    """One weight sync, trainer -> rollout engines."""

    seconds: float = stat("sync/seconds", default=0.0)
    export_s: float = stat("sync/export_s", default=0.0)
    load_s: float = stat("sync/load_s", default=0.0)
    bytes: float = stat("sync/bytes", default=0.0)
    buckets: float = stat("sync/buckets", default=0.0)
    shm: bool = stat("sync/shm", default=False)
    nccl: bool | None = stat("sync/nccl")
    lora_adapter: bool | None = stat("sync/lora_adapter")  # None: the run has no LoRA

    def as_metrics(self) -> dict[str, float]:
        return {**metrics_of(self), "sync/bytes_per_s": self.bytes / max(self.seconds, 1e-9)}


@dataclass(frozen=True)
class GapStats:
    """Engine vs trainer logprobs of the same generated tokens under the same weights."""

    abs_mean: float = stat("mismatch/logprob_abs_mean", default=0.0)
    abs_max: float = stat("mismatch/logprob_abs_max", default=0.0)

    def as_metrics(self) -> dict[str, float]:
        return metrics_of(self)
