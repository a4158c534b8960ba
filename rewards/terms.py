"""Reward terms shared by domains. Each is `EpisodeSummary -> float` (or builds one).

- `check(name)`: a final-state result the domain's grader reported (e.g. `correct` in [0, 1]).
- `malformed_fraction`: share of the model's calls the framework had to reject; use with a
  negative weight (a penalty) so a do-nothing episode still scores 0.
- `format_validity`: 1 - malformed_fraction (1.0 when there were no calls).
- `turn_fraction`: turns used / max turns; with a negative weight it is a length penalty.
- `response_chars(scale)`: assistant characters (content + reasoning) / scale; a token-free
  length penalty for domains that want one.
"""
from __future__ import annotations

from rewards.rubric import EpisodeSummary, RewardFn


def check(name: str) -> RewardFn:
    def term(ep: EpisodeSummary) -> float:
        if name not in ep.checks:
            # A missing check is a grader bug, not a wrong answer: raise so it becomes a visible error.
            raise KeyError(f"the domain grader did not report check '{name}' (it reported: {sorted(ep.checks)})")
        return float(ep.checks[name])

    term.__name__ = f"check_{name}"
    return term


def malformed_fraction(ep: EpisodeSummary) -> float:
    return ep.malformed_calls / ep.tool_calls if ep.tool_calls else 0.0


def format_validity(ep: EpisodeSummary) -> float:
    return 1.0 - malformed_fraction(ep)


def turn_fraction(ep: EpisodeSummary) -> float:
    return ep.num_turns / max(1, ep.task.limits.max_turns)


def response_chars(scale: float) -> RewardFn:
    if scale <= 0:
        raise ValueError(f"response_chars: scale must be > 0, got {scale}")

    def term(ep: EpisodeSummary) -> float:
        n = sum(len(m.content) + len(m.reasoning or "") for m in ep.messages if m.role == "assistant")
        return n / scale

    return term
