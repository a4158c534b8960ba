"""Typed records that cross component boundaries in the RL loop: episodes, groups, step metrics.

Data only. Producers: the agent loop (Episode), the driver (RolloutGroup, StepMetrics). Consumers:
the trainer (which packs episodes into its own tensor batch, `rl/trainer/batch.py: TrainBatch`),
the metrics logger and the report. Records shared with environments (Message, Task, ...) live in
`jointrl.records`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

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
