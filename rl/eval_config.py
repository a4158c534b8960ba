"""The `eval` section of the run config: the held-out evaluation before and after RL (and `jointrl eval`).

Declared here, once, with every key's default and the section's own checks (`__post_init__`, each error naming
the key); rl/config.py composes it into RunConfig. rl/evaluate.py runs the episodes and rl/eval_plan.py
apportions an episode budget across families and domains; nothing here runs an episode.
"""
from __future__ import annotations

from dataclasses import dataclass

from rl.errors import ConfigError


@dataclass
class EvalSection:
    """Held-out evaluation before and after RL (and `jointrl eval`)."""

    n_per_domain: int = 0  # held-out tasks per domain; 0 = max(2, trainer.tasks_per_step)
    # Held-out episodes per evaluation arm over all domains, split across families, then domains
    # (rl/eval_plan.py: one task per domain where it allows, then even per family, by weight inside one);
    # for runs with hundreds of domains. 0 = off (eval.n_per_domain tasks in every domain).
    budget_episodes: int = 0
    samples: int = 1  # episodes per task; success/reward are means over all of them (pass@1 estimate)
    temperature: float = 0.0  # 0 = greedy; with samples > 1 use the training temperature to measure the policy itself
    seed: int = 12345
    # After RL, also evaluate the third arm: the trainer state RL started from (saved after the SFT warm
    # start), trained with SFT for as long as RL ran. Shows whether the gain is RL's or more supervision's.
    sft_control: bool = False

    def __post_init__(self) -> None:
        if self.samples <= 0:
            raise ConfigError(f"config key 'eval.samples': value {self.samples} must be > 0")
        for k, v in {"eval.n_per_domain": self.n_per_domain, "eval.temperature": self.temperature}.items():
            if v < 0:
                raise ConfigError(f"config key '{k}': value {v} must be >= 0")
        if self.budget_episodes < 0:
            raise ConfigError(f"config key 'eval.budget_episodes': value {self.budget_episodes} must be >= 0 (0 = off)")
        if 0 < self.budget_episodes < self.samples:
            raise ConfigError(f"config key 'eval.budget_episodes': value {self.budget_episodes} is less than one task's "
                              f"eval.samples={self.samples} episodes; allowed: 0 (off) or >= eval.samples")
        if self.budget_episodes and self.n_per_domain:
            raise ConfigError("config keys 'eval.budget_episodes' and 'eval.n_per_domain': set one of them (the budget "
                              f"decides tasks per domain itself); got {self.budget_episodes} and {self.n_per_domain}")
        if self.samples > 1 and self.temperature == 0.0:
            raise ConfigError("config key 'eval.samples': more than one sample per task needs eval.temperature > 0 "
                              "(greedy samples are identical)")
