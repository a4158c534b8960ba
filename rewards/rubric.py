"""A `Rubric`: the episode reward as a weighted sum of small, named reward terms.

    reward = sum_i weight_i * term_i(episode)          (finished episodes)
    reward = rubric.truncated_reward                    (a budget ended the episode)
    reward = rubric.error_reward, Grade.error set       (the grader or a term failed)

Each term is a plain function `EpisodeSummary -> float` with an explicit signature, so a rubric
reads like its formula and each term is testable alone. Truncated and errored episodes get
fixed, visible outcomes (the verifiers lesson: a grader exception silently scored 0 hides bugs),
and every term's raw value is logged as `term/<name>` even when it does not decide the reward.

This module does not run episodes or graders; `envs.base.ToolEnv` builds the `EpisodeSummary`
(domain checks included) and calls `Rubric.score`.
"""
from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from typing import Callable, Mapping

from jointrl.records import Grade, Message, Task


@dataclass(frozen=True)
class EpisodeSummary:
    """Everything a reward term may look at, after the episode and the domain's checks.

    checks: the domain grader's final-state results by name (e.g. {"correct": 1.0}).
    tool_calls / malformed_calls: calls the model made, and how many the framework rejected
    (bad JSON, unknown tool, wrong types, oversize, text where a call was needed).
    """

    task: Task
    messages: tuple[Message, ...]
    checks: Mapping[str, float]
    num_turns: int
    tool_calls: int
    malformed_calls: int
    terminated: bool
    truncated: bool


RewardFn = Callable[[EpisodeSummary], float]


@dataclass(frozen=True)
class Term:
    """One weighted reward term. `fn` returns a finite float; `name` is unique within a rubric."""

    name: str
    fn: RewardFn
    weight: float = 1.0


class RubricError(ValueError):
    """The rubric itself is malformed (duplicate names, non-finite weights): an author error."""


@dataclass(frozen=True)
class Rubric:
    terms: tuple[Term, ...]
    truncated_reward: float = 0.0  # fixed reward when a budget ended the episode
    error_reward: float = 0.0  # fixed reward when grading failed (always reported via Grade.error)
    extra_metrics: tuple[str, ...] = field(default=())  # domain checks to copy into metrics as-is

    def __post_init__(self) -> None:
        names = [t.name for t in self.terms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise RubricError(f"duplicate reward term name(s): {', '.join(dup)}")
        for t in self.terms:
            if not callable(t.fn):
                raise RubricError(f"reward term '{t.name}': fn is not callable")
            if not math.isfinite(t.weight):
                raise RubricError(f"reward term '{t.name}': weight {t.weight!r} is not finite")
        for v, what in ((self.truncated_reward, "truncated_reward"), (self.error_reward, "error_reward")):
            if not math.isfinite(v):
                raise RubricError(f"{what} {v!r} is not finite")

    def score(self, ep: EpisodeSummary) -> Grade:
        """The Grade of a finished episode. Never raises: a failing term gives an error Grade."""
        metrics: dict[str, float] = {f"check/{k}": float(v) for k, v in ep.checks.items()}
        values: dict[str, float] = {}
        for t in self.terms:
            try:
                v = float(t.fn(ep))
            except Exception as e:  # noqa: BLE001 - any failure of a term is a grading error, reported
                return self.error(f"reward term '{t.name}' raised {type(e).__name__}: {e}",
                                  detail=traceback.format_exc(limit=3), metrics=metrics)
            if not math.isfinite(v):
                return self.error(f"reward term '{t.name}' returned non-finite value {v!r}", metrics=metrics)
            values[t.name] = v
            metrics[f"term/{t.name}"] = v
        metrics["truncated"] = float(ep.truncated)
        metrics["grade_error"] = 0.0
        if ep.truncated:
            return Grade(reward=self.truncated_reward, metrics=metrics)
        return Grade(reward=sum(t.weight * values[t.name] for t in self.terms), metrics=metrics)

    def error(self, message: str, *, detail: str | None = None, metrics: Mapping[str, float] | None = None) -> Grade:
        """The fixed, visible outcome of a grading failure: `error_reward`, `grade_error=1`, the message."""
        m = dict(metrics or {})
        m["grade_error"] = 1.0
        return Grade(reward=self.error_reward, metrics=m, error=message if detail is None else f"{message}\n{detail}")
