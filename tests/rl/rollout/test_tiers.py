"""The tier -> token budget rule (rl/rollout/tiers.py), the one the agent loop and the server both use."""
from __future__ import annotations

import pytest

from jointrl.records import Task
from rl.rollout.tiers import TIERS, TierError, tier_budget


def test_tier_names_are_the_records_literal():
    assert TIERS == ("low", "high", "max")
    assert Task.__dataclass_fields__["thinking"].default in TIERS


def test_a_budget_per_tier_and_negative_means_no_cap():
    budgets = {"low": 64, "high": 256, "max": -1}
    assert [tier_budget(t, budgets) for t in TIERS] == [64, 256, None]
    assert tier_budget("low", {"low": 0}) == 0  # zero is a budget (no thinking), not "no cap"


@pytest.mark.parametrize("tier, budgets, says", [
    ("medium", {"low": 64, "high": 256, "max": -1}, "unknown tier"),
    ("high", {"low": 64, "max": -1}, "no budget is set"),
])
def test_an_unknown_or_unbudgeted_tier_is_one_clear_error(tier, budgets, says):
    with pytest.raises(TierError, match=says) as e:
        tier_budget(tier, budgets)
    assert repr(tier) in str(e.value) and "low, high, max" in str(e.value)


def test_the_agent_loop_and_the_server_ask_the_same_rule():
    from rl.rollout.agent_loop import LoopSettings, _generation_caps
    from rl.serve.settings import ServeSettings

    class NoThinkingBlock:
        reasoning_markers = None

    s = LoopSettings(max_new_tokens_per_turn=256, thinking_budgets={"low": 64, "max": -1})
    with pytest.raises(TierError, match="'high'"):
        _generation_caps(NoThinkingBlock(), s, "high", room=1000)  # was: silently no cap
    serve = ServeSettings()
    with pytest.raises(TierError, match="'medium'"):
        serve.tier_budget("medium")  # was: KeyError
    assert [serve.tier_budget(t) for t in TIERS] == [tier_budget(t, serve.thinking_budgets) for t in TIERS]
