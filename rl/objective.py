"""The RL training objective the trainer minimises, composed from rl/algos by name.

    loss = policy_loss(ratio vs pi_old, advantages; TIS weights for the engine/trainer mismatch)
         + kl_coef * k(pi, pi_ref)                        (when reference logprobs are present)
         + router aux / z terms on the routes actually used (replayed routes under R2/R3)

k is the per-token KL estimator `kl_estimator`. Its value estimates KL(pi || pi_ref); its gradient as
a loss does not always follow that KL: with k3 (the default) the expected gradient is that of
KL(pi_ref || pi) (rl/algos/kl.py).

Aggregation weights are computed once on the whole step batch by the driver (`loss_weights_BT`)
and sliced with the micro-batch, so gradient accumulation gives exactly the whole-batch objective.
`RLObjective` is a frozen dataclass (picklable for Ray) holding only names and coefficients.

`AlgorithmSection`, the run config's `algorithm` section, is declared here once with every key's default and
its own checks (`__post_init__`, each error naming the key); rl/config.py composes it into RunConfig, and
`RLObjective` takes its defaults from it. The module imports torch and rl/algos only when a loss is computed,
so reading a config stays light.

`loss_advantages` is the step-batch part of the objective: it reads `algorithm.whiten_advantages` and
whitens the estimator's advantages over the whole step batch before any micro-batch sees them ("auto":
on for `gae`, as verl and OpenRLHF do for PPO; off for the group estimators, whose advantages are
already centred per group, and for `reinforce_pp`, which whitens by itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from rl.errors import ConfigError
from rl.model_config import ModelSection

if TYPE_CHECKING:
    import torch

WHITEN_SETTINGS = ("auto", True, False)


@dataclass
class AlgorithmSection:
    """RL math choices; names refer to registries in rl/algos."""

    # gae: PPO with a critic (a value head on its own copy of the policy, rl/trainer/critic.py)
    advantage: Literal["grpo", "dr_grpo", "rloo", "gae", "reinforce_pp"] = "grpo"
    policy_loss: Literal["ppo_clip", "dual_clip", "gspo", "cispo"] = "ppo_clip"
    aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "domain_token_mean"] = "domain_token_mean"
    group_size: int = 4  # G samples per task
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False  # subtract kl_coef x the episode's summed k1 KL to the reference from its reward
    tis_cap: float = 2.0  # truncated importance sampling cap (rollout vs trainer logprobs); <=0 disables
    # filter: drop groups whose rewards are all equal (DAPO); oversample: also roll out more tasks until
    # trainer.tasks_per_step groups have signal, at most oversample_factor x tasks_per_step tasks in all
    dynamic_sampling: Literal["off", "filter", "oversample"] = "filter"
    oversample_factor: float = 2.0
    gamma: float = 1.0  # gae, reinforce_pp: discount per generated token
    lam: float = 0.95  # gae: GAE lambda (Schulman et al. 2016)
    value_clip: float = 0.2  # gae: the critic's clipped value loss range; <= 0 = plain squared error
    # whiten the advantages over the step batch before the loss ((A - mean) / std over generated tokens;
    # rl/objective.py: loss_advantages). auto: on for gae (as verl and OpenRLHF do), off otherwise
    whiten_advantages: Literal["auto", True, False] = "auto"

    def __post_init__(self) -> None:
        if self.group_size <= 0:
            raise ConfigError(f"config key 'algorithm.group_size': value {self.group_size} must be > 0")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ConfigError(f"config keys 'algorithm.gamma' / 'algorithm.lam': {self.gamma} / {self.lam} "
                              "must each be in [0, 1]")
        if self.oversample_factor < 1.0:
            raise ConfigError(f"config key 'algorithm.oversample_factor': value {self.oversample_factor} must be >= 1")
        if self.kl_coef < 0:
            raise ConfigError(f"config key 'algorithm.kl_coef': value {self.kl_coef} must be >= 0")
        if self.kl_in_reward and self.kl_coef == 0:
            raise ConfigError("config key 'algorithm.kl_in_reward': needs algorithm.kl_coef > 0 (the penalty's coefficient)")


def whitens(advantage: str, whiten_advantages: str | bool) -> bool:
    """Whether the advantages of estimator `advantage` are whitened under setting `whiten_advantages`."""
    if whiten_advantages == "auto" and isinstance(whiten_advantages, str):
        return advantage == "gae"
    if isinstance(whiten_advantages, bool):
        return whiten_advantages
    raise ValueError(f"whiten_advantages must be one of {WHITEN_SETTINGS}, got {whiten_advantages!r}")


def loss_advantages(advantages_BT: torch.Tensor, mask_BT: torch.Tensor, advantage: str, whiten_advantages: str | bool
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages the loss sees: the estimator's, whitened over this (whole step) batch when `whitens`.
    Metrics: `adv/whitened` (0/1), and when whitened the mean and std that were removed."""
    from rl.algos import ADVANTAGE_TRANSFORMS

    if not whitens(advantage, whiten_advantages):
        return advantages_BT, {"adv/whitened": 0.0}
    out_BT, metrics = ADVANTAGE_TRANSFORMS.get("whiten")(advantages_BT, mask_BT)
    metrics["adv/whitened"] = 1.0
    return out_BT, metrics


@dataclass(frozen=True)
class RLObjective:
    policy_loss: str = AlgorithmSection.policy_loss
    clip_low: float = AlgorithmSection.clip_low
    clip_high: float = AlgorithmSection.clip_high
    tis_cap: float = AlgorithmSection.tis_cap  # <= 0 disables truncated importance sampling
    kl_coef: float = AlgorithmSection.kl_coef
    kl_estimator: str = AlgorithmSection.kl_estimator
    router_aux_coef: float = ModelSection.router_aux_loss_coef
    router_z_coef: float = ModelSection.router_z_loss_coef
    def __call__(self, logprobs_BT: torch.Tensor, mb: Any, router_logits: Sequence[torch.Tensor] | None = None,
                 routes_LNK: torch.Tensor | None = None, token_mask_N: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """`token_mask_N`: the real tokens among the router logits' N rows when the forward did not run `mb`'s
        padded [B, T] layout (a shared-prefix packed forward, rl/trainer/packing.py); default: mb's attention mask."""
        from rl.algos import PolicyLossInputs, PolicyLossParams, compute_policy_loss, kl_loss, router_losses, truncated_is_weights

        mask = mb.loss_mask_BT > 0
        old = mb.old_logprobs_BT if mb.old_logprobs_BT is not None else logprobs_BT.detach()
        metrics: dict[str, float] = {}
        is_w = None
        if self.tis_cap > 0 and bool(mask.any()):
            is_w, m = truncated_is_weights(old, mb.rollout_logprobs_BT, mask, cap=self.tis_cap)
            metrics.update(m)
        inputs = PolicyLossInputs(logprobs_BT=logprobs_BT, old_logprobs_BT=old, advantages_BT=mb.advantages_BT,
                                  mask_BT=mask, is_weights_BT=is_w)
        loss, m = compute_policy_loss(self.policy_loss, inputs, PolicyLossParams(clip_low=self.clip_low, clip_high=self.clip_high),
                                      weights_BT=mb.loss_weights_BT)
        metrics.update(m)
        if self.kl_coef > 0 and mb.ref_logprobs_BT is not None:
            kl, m = kl_loss(logprobs_BT, mb.ref_logprobs_BT, mask, estimator=self.kl_estimator, coef=self.kl_coef,
                            weights_BT=mb.loss_weights_BT)
            loss = loss + kl
            metrics.update(m)
        if router_logits is not None and len(router_logits) > 0:
            if token_mask_N is None:
                token_mask_N = mb.attention_mask_BT.reshape(-1) > 0
            token_mask_N = token_mask_N > 0
            if routes_LNK is None:
                raise ValueError("RLObjective: router_logits given without the routes the forward used")
            r_loss, m = router_losses(list(router_logits), routes_LNK, token_mask_N,
                                      aux_coef=self.router_aux_coef, z_coef=self.router_z_coef)
            # Router terms are per-token means; weight by this micro-batch's share of the step's tokens.
            share = float(mb.attention_mask_BT.sum()) / max(float(mb.step_tokens or mb.attention_mask_BT.sum()), 1.0)
            loss = loss + r_loss * share
            metrics.update(m)
        metrics["loss/total"] = float(loss.detach())
        return loss, metrics
