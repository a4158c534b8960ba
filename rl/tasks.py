"""The `envs` section of the run config, and the run's task pools: the train and held-out tasks of every weighted
domain, and the environments they run in.

`EnvsSection` is declared here, once, with its keys' defaults (rl/config.py composes it; the domain sampler,
rl/sampler.py, takes its defaults from it).

`TaskPools.load(envs_section, prompt_views)` reads the `envs` section: each domain key of `envs.weights`
with a weight above 0, its env id (`envs.env_ids`), its train split (RL and SFT) and held-out split
(evaluation), every task labelled with the run's domain key, its turn limit capped at `envs.max_turns`
and its thinking tier defaulted from `envs.default_tier`. `make_env(task)` builds the task's environment.

It does not sample tasks (rl/sampler.py), run episodes (rl/rollout/rollouts.py) or grade them (envs/).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from jointrl.records import Task
from rl.errors import ConfigError
from rl.rollout.tiers import TIERS


@dataclass
class EnvsSection:
    """Environments and the joint sampler."""

    weights: dict[str, float] = field(default_factory=lambda: {"terminal": 1.0})  # domain -> sampling weight
    env_ids: dict[str, str] = field(default_factory=lambda: {"terminal": "terminal-v0", "swe": "swe-v0", "browse": "browse-v0", "cad": "cad-v0"})
    adaptive_weights: bool = False  # move the weights after each step by `sampler_rule` (rl/sampler.py)
    min_weight: float = 0.05  # floor for adaptive weights so no domain (or family) starves
    # variance: toward reward variance; learnability: variance x 4p(1-p); dump: UCB on mean |advantage| (arXiv 2504.09710)
    sampler_rule: Literal["variance", "learnability", "dump"] = "variance"
    sampler_level: Literal["domain", "family"] = "domain"  # family: adapt per family (the run record's), split by base weight
    dump_c: float = 1.0  # DUMP's UCB exploration coefficient
    dump_temperature: float = 0.1  # softmax temperature from UCB scores to weights
    default_tier: dict[str, str] = field(default_factory=lambda: {"terminal": "low", "swe": "high", "browse": "high", "cad": "high"})  # the tier of a domain's tasks that carry none (a task's own tier wins)
    # concurrent sandboxes of the SFT demonstration replays only (rl/sft.py); RL episodes are bounded by
    # rollout.max_concurrent_episodes, not by this key
    sandbox_slots: int = 4
    # Domains from the author's own files or modules, neither built in nor packaged: each a path to a .py file
    # (relative to the working directory) or a module name, imported before env ids are checked; its
    # `register()` registers the domain (docs/envs.md, "Writing a domain"). Also $JOINTRL_ENV_PLUGINS.
    plugins: list[str] = field(default_factory=list)
    max_turns: int = 8
    seed: int = 0



@dataclass(frozen=True)
class TaskPools:
    domains: tuple[str, ...]  # the weighted domains, in `envs.weights` order
    env_ids: dict[str, str]  # domain -> env id
    train: dict[str, list[Task]]  # domain -> train-split tasks
    heldout: dict[str, list[Task]]  # domain -> held-out tasks (evaluation only)
    prompt_views: bool = False  # whether environments that offer prompt images put them in the prompt

    @classmethod
    def load(cls, envs_section: EnvsSection, prompt_views: bool = False) -> "TaskPools":
        """The pools of the `envs` section. A curriculum rung and its full domain (e.g. terminal-basics-v0 and
        terminal-v0, both "terminal" in their env) are labelled with their own domain keys, so they are sampled,
        logged and evaluated apart. `prompt_views`: the policy takes images (rollout.max_images_per_prompt > 0)."""
        import envs

        e = envs_section
        envs.load_plugins(e.plugins)  # loaded by the config's validation already; a config built in code too
        domains = tuple(d for d, w in e.weights.items() if w > 0)
        env_ids = {d: e.env_ids[d] for d in domains}
        train: dict[str, list[Task]] = {}
        heldout: dict[str, list[Task]] = {}
        for d in domains:
            tier = e.default_tier.get(d, "high")
            train[d] = [_with_defaults(Task.from_row(r), tier, d, e.max_turns) for r in envs.tasks(env_ids[d], "train", seed=e.seed)]
            heldout[d] = [_with_defaults(Task.from_row(r), tier, d, e.max_turns) for r in envs.tasks(env_ids[d], "heldout", seed=e.seed)]
        return cls(domains=domains, env_ids=env_ids, train=train, heldout=heldout, prompt_views=prompt_views)

    def make_env(self, task: Task) -> Any:
        import envs

        env = envs.make(self.env_ids[task.domain])
        # A policy that takes images gets the task's pictures in its prompt where the env offers them (cad-v0's
        # target views); text-only runs keep text-only prompts (their codecs and SFT data take no images).
        if self.prompt_views and hasattr(env, "prompt_views"):
            env.prompt_views = True
        return env

    def check_sandboxes(self) -> None:
        """Make one environment of each domain: a domain that needs a sandbox builds its backend then, which raises
        `SandboxUnavailable` (with what to change, e.g. no root and no user namespaces) before anything starts."""
        from envs.sandbox.base import SandboxUnavailable

        for d in self.domains:
            try:
                env = self.make_env(self.train[d][0]) if self.train[d] else None
            except SandboxUnavailable as e:
                raise ConfigError(f"domain {d!r} ({self.env_ids[d]}) needs a sandbox, and none can start here: {e}") from None
            if env is not None:
                env.close()


def _with_defaults(t: Task, tier: str, domain: str, max_turns: int) -> Task:
    limits = replace(t.limits, max_turns=min(t.limits.max_turns, max_turns))
    return replace(t, domain=domain, limits=limits, thinking=t.thinking if t.thinking in TIERS else tier)
