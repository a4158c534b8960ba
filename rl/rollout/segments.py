"""One context of an episode under construction (`SegmentBuilder`), and a step's generation budget (`StepBudget`:
generated tokens, wall time, or both).

A segment's token list only ever grows by appending: prompt and observation tokens with loss mask 0, the
engine's generated tokens with loss mask 1, their logprobs and the policy version that generated them, and the
engine's expert choices (R3) turn by turn. An episode whose history is compacted (rl/rollout/context.py) closes
its segment and opens a new one on the compacted context; the closed ones become `rl.types.Segment`s.
What this module does not do: render, generate or decide anything (the agent loop does).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from rl.rollout.engine import GenerateResult
from rl.rollout.multimodal import EpisodeImages
from rl.types import Segment


@dataclass
class StepBudget:
    """What one training step may spend on rollouts (partial rollouts): `tokens` generated tokens
    (`rollout.step_token_budget`) and `seconds` of wall time from the budget's creation
    (`rollout.step_time_budget_s`); 0 turns either off, and at least one must be on. Once either is spent
    (whichever comes first), every episode of the step pauses at its next turn boundary.

    The clock is read at those boundaries only: a request in flight finishes, so a step overruns its time
    budget by at most one turn of its slowest running episode."""

    tokens: int = 0
    seconds: float = 0.0
    spent: int = 0
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)
    hit: str | None = field(default=None, init=False)  # the budget found spent first: "tokens" or "time"

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.seconds < 0 or not (self.tokens > 0 or self.seconds > 0):
            raise ValueError(f"StepBudget needs tokens >= 1 or seconds > 0 (0 = that budget off), got tokens={self.tokens}, "
                             f"seconds={self.seconds}")
        self.started = self.clock()

    @property
    def exhausted(self) -> bool:
        if self.hit is None:
            if self.tokens > 0 and self.spent >= self.tokens:
                self.hit = "tokens"
            elif self.seconds > 0 and self.clock() - self.started >= self.seconds:
                self.hit = "time"
        return self.hit is not None


@dataclass
class SegmentBuilder:
    """The tokens of the current context, with their loss mask, logprobs, versions and routes."""

    images: EpisodeImages
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    _routes: list[np.ndarray] = field(default_factory=list)
    routed: int = 0  # prompt tokens whose routes the engine has reported (the next request's routed_experts_prompt_start)
    _routes_ok: bool = True

    def add_input(self, ids: Sequence[int]) -> None:
        """Tokens the policy reads but did not write (prompt, template, observations): not trained on."""
        self.tokens.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([0] * len(ids))

    def add_generated(self, res: GenerateResult, version: int) -> list[int]:
        out = list(res.token_ids)
        self.tokens.extend(out)
        self.mask.extend([1] * len(out))
        self.logprobs.extend(list(res.logprobs))
        self.versions.extend([version] * len(out))
        if res.routed_experts is not None and self._routes_ok:
            r = np.asarray(res.routed_experts)
            self._routes.append(r)
            self.routed += int(r.shape[0])
        else:
            self._routes_ok = False
        return out

    def routes(self) -> np.ndarray | None:
        """[len(tokens), L, k] expert ids, or None when the engine did not report them for every turn."""
        if not (self._routes_ok and self._routes):
            return None
        r = np.concatenate(self._routes, axis=0)
        # The last token(s) were never fed through the engine; their routes affect no trained logprob, so the
        # last row is repeated to keep the shapes aligned.
        if 0 < r.shape[0] < len(self.tokens):
            r = np.concatenate([r, np.repeat(r[-1:], len(self.tokens) - r.shape[0], axis=0)], axis=0)
        return r[: len(self.tokens)]

    def generated_versions(self) -> set[int]:
        return {v for v, m in zip(self.versions, self.mask) if m}

    def close(self, keep_versions: bool) -> Segment:
        return Segment(token_ids=tuple(self.tokens), loss_mask=tuple(self.mask), rollout_logprobs=tuple(self.logprobs),
                       routed_experts=self.routes(), images=tuple(self.images.items),
                       token_versions=tuple(self.versions) if keep_versions else ())
