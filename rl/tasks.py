"""The `envs` section of the run config, and the run's task pools: the train and held-out tasks of every weighted
domain, and the environments they run in.

`EnvsSection` is declared here, once, with its keys' defaults and its checks (`check_*`, each error naming the key;
`check_env_ids` imports the `envs.plugins` first); rl/config.py composes it and calls them; the domain sampler,
rl/sampler.py, takes its defaults from it.

`TaskPools.load(envs_section, prompt_views)` reads the `envs` section: each domain key of `envs.weights`
with a weight above 0, its env id (`envs.env_ids`), its train split (RL and SFT) and held-out split
(evaluation), every task labelled with the run's domain key, its turn limit capped at `envs.max_turns`
and its thinking tier defaulted from `envs.default_tier`. `make_env(task)` builds the task's environment.

It does not sample tasks (rl/sampler.py), run episodes (rl/rollout/rollouts.py) or grade them (envs/).
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
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



# ----------------------------------------------------------------------------- the section's checks
def check_weights(e: EnvsSection) -> None:
    """Every weighted domain is a key of `envs.env_ids` (with the nearest suggested); weights >= 0, one > 0."""
    known = set(e.env_ids)
    for d, w in e.weights.items():
        if d not in known:
            near = difflib.get_close_matches(d, sorted(known), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"config key 'envs.weights.{d}': unknown domain '{d}'{hint} (known domains: {', '.join(sorted(known))})")
        if w < 0:
            raise ConfigError(f"config key 'envs.weights.{d}': weight {w} must be >= 0")
    if e.weights and sum(e.weights.values()) <= 0:
        raise ConfigError("config key 'envs.weights': at least one domain needs a positive weight")


def check_default_tiers(e: EnvsSection) -> None:
    allowed_tiers = ", ".join(repr(t) for t in TIERS)
    for d, tier in e.default_tier.items():
        if tier not in TIERS:
            raise ConfigError(f"config key 'envs.default_tier.{d}': value {tier!r} is not allowed; allowed values: {allowed_tiers}")


def check_sampler(e: EnvsSection) -> None:
    for k, v in {"envs.dump_c": e.dump_c, "envs.min_weight": e.min_weight}.items():
        if v < 0:
            raise ConfigError(f"config key '{k}': value {v} must be >= 0")
    if e.dump_temperature <= 0:
        raise ConfigError(f"config key 'envs.dump_temperature': value {e.dump_temperature} must be > 0")


def check_env_ids(e: EnvsSection) -> None:
    """Every weighted domain's `envs.env_ids` entry is a registered environment (with the nearest id suggested)."""
    import envs
    from envs.registry import PLUGINS_ENV

    if e.plugins:
        envs.load_plugins(e.plugins)
        failed = {k: v for k, v in envs.discovery_errors().items() if k.startswith("plugin:") and k[7:] in e.plugins}
        if failed:
            raise ConfigError(f"config key 'envs.plugins': {'; '.join(f'{k[7:]}: {v}' for k, v in failed.items())}")
        have = [p for p in os.environ.get(PLUGINS_ENV, "").split(os.pathsep) if p]
        os.environ[PLUGINS_ENV] = os.pathsep.join(dict.fromkeys(have + [str(Path(p).resolve()) if p.endswith(".py") else p
                                                                          for p in e.plugins]))  # child processes too
    known = [s.env_id for s in envs.list_envs()]
    for d, w in e.weights.items():
        env_id = e.env_ids.get(d)
        if w <= 0 or env_id in known:
            continue
        near = difflib.get_close_matches(str(env_id), known, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        skipped = envs.discovery_errors()
        why = f" (environments that failed to load: {', '.join(sorted(skipped))})" if skipped else ""
        raise ConfigError(f"config key 'envs.env_ids.{d}': unknown environment id {env_id!r}{hint} (`jointrl envs list` "
                          f"shows the {len(known)} registered ids){why}")


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
