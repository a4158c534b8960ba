"""Rewards: a `Rubric` of weighted terms with fixed outcomes for truncated / errored episodes."""
from rewards.rubric import EpisodeSummary, RewardFn, Rubric, RubricError, Term
from rewards.terms import check, format_validity, malformed_fraction, response_chars, turn_fraction

__all__ = ["EpisodeSummary", "RewardFn", "Rubric", "RubricError", "Term", "check", "format_validity",
           "malformed_fraction", "response_chars", "turn_fraction"]
