"""The RL math: advantages, policy losses, loss aggregation, KL, off-policy correction, value loss,
router terms and dynamic-sampling helpers, as small pure torch functions.

Tensors in, `(tensor, metrics: dict[str, float])` out; no config objects, no ray / deepspeed / vllm.
Names used by `rl.config.AlgorithmSection` resolve through the registries re-exported here. See
docs/algorithms.md for the formulas, their papers, and how to add an estimator or a loss.
"""
from rl.algos.advantages import (
    ADVANTAGE_TRANSFORMS,
    ADVANTAGES,
    AdvantageInputs,
    AdvantageParams,
    broadcast_to_tokens,
    compute_advantages,
    gae_advantages_BT,
    gae_returns_BT,
    grpo_advantages_B,
    outcome_to_token_rewards,
    reinforce_pp_advantages_BT,
    rloo_advantages_B,
    whiten,
    whiten_advantages,
)
from rl.algos.aggregation import AGGREGATIONS, aggregate, aggregation_weights, reduce
from rl.algos.dynamic_sampling import GroupSignal, group_signal, zero_variance_groups
from rl.algos.kl import KL_ESTIMATORS, kl_loss, kl_per_token, kl_reward_penalty
from rl.algos.off_policy import masked_is_mask, truncated_is_weights
from rl.algos.policy_loss import POLICY_LOSSES, PolicyLossInputs, PolicyLossParams, compute_policy_loss
from rl.algos.registry import Registry, RegistryError
from rl.algos.router import load_balance_loss, router_losses, router_z_loss
from rl.algos.value import clipped_value_loss

__all__ = [
    "ADVANTAGE_TRANSFORMS", "ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES",
    "AdvantageInputs", "AdvantageParams", "GroupSignal", "PolicyLossInputs", "PolicyLossParams", "Registry", "RegistryError",
    "aggregate", "aggregation_weights", "broadcast_to_tokens", "clipped_value_loss", "compute_advantages",
    "compute_policy_loss", "gae_advantages_BT", "gae_returns_BT", "group_signal", "grpo_advantages_B",
    "kl_loss", "kl_per_token", "kl_reward_penalty", "load_balance_loss", "masked_is_mask",
    "outcome_to_token_rewards", "reduce", "reinforce_pp_advantages_BT", "rloo_advantages_B", "router_losses",
    "router_z_loss", "truncated_is_weights", "whiten", "whiten_advantages", "zero_variance_groups",
]
