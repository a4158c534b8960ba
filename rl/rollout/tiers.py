"""Thinking tiers: their names, and the one rule that turns a tier into a token budget.

A task (and a served request) names a tier, `low`, `high` or `max` (`jointrl.records.ThinkingTier`);
a budgets mapping (the config's `rollout.thinking_budgets`, the server's `--thinking-budgets`) says how
many tokens each tier may think for, a negative number meaning no cap. The agent loop and the server
both ask `tier_budget`, so an unknown or unbudgeted tier fails the same way everywhere. What this module
does not do: apply the budget (the engine's thinking budget, or the turn cap of a format without a
thinking block, is the agent loop's choice).
"""
from __future__ import annotations

from typing import Mapping, get_args

from jointrl.records import ThinkingTier

TIERS: tuple[str, ...] = get_args(ThinkingTier)


class TierError(ValueError):
    """A tier that is not one of TIERS, or one the budgets mapping gives no budget."""


def tier_budget(tier: str, budgets: Mapping[str, int]) -> int | None:
    """The token budget of `tier` under `budgets` (tier -> tokens); None when the tier has no cap (< 0)."""
    if tier not in budgets:
        known = "unknown tier" if tier not in TIERS else "no budget is set for it"
        raise TierError(f"thinking tier {tier!r}: {known}; tiers: {', '.join(TIERS)}; budgets set: {dict(budgets)}")
    n = budgets[tier]
    return None if n < 0 else int(n)
