"""The `logging` section of the run config: where metrics go and how per-domain metrics reach wandb.

Declared here, once, with every key's default; rl/config.py composes it into RunConfig. The metrics sink
(rl/observe/sink.py) and its wandb layout read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rl.errors import ConfigError


@dataclass
class LoggingSection:
    """Where metrics go."""

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "jointrl"
    samples_per_domain: int = 2  # rollout transcripts logged per domain per step
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # How per-domain metrics (`<group>/<stat>/<domain>`, ~80 a domain at 16 experts) go to wandb, which draws
    # one panel per series (rl/observe/wandb_layout.py). "scalars": every name its own series (fine for a
    # handful of domains; 500 domains would be ~40,000 series). "table": the batch-wide names, every
    # `<stat>/all` and a few per-family roll-ups (`family/<stat>/<family>`) stay series, and every domain's
    # values go to one wandb.Table `domains/table` (a row per domain) every `wandb_table_every` steps.
    # "auto": "scalars" up to `wandb_table_above` domains of the run record, "table" above.
    # metrics.jsonl and `jointrl report` always get every name.
    wandb_per_domain: Literal["auto", "scalars", "table"] = "auto"
    # Domains above which "auto" switches to the table; also the most families logged as roll-up series
    # (more families: a `families/table` instead). 12 is where the report switches to per-family charts.
    wandb_table_above: int = 12
    # Log the domain table every k-th step and at the last planned step. At 500 domains a table is ~0.43 MB and
    # ~0.3 s of wandb's time (docs/dashboards.md); every step's values are in metrics.jsonl and the report anyway.
    wandb_table_every: int = 10
    # The engine-vs-trainer logprob check after a weight sync (rl/sync.py WeightSync.gap: the engine and the trainer
    # each score a few of the step's episodes, `mismatch/logprob_abs_{mean,max}`) runs at steps 0, k, 2k, ...
    # 1: every step. 0: never (the train-time `mismatch/*/<domain>` gap of each update is logged regardless).
    # On a 2-core CPU it is ~10% of a small step (docs/peers.md).
    gap_every: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.gap_every, bool) or not isinstance(self.gap_every, int) or self.gap_every < 0:
            raise ConfigError(f"config key 'logging.gap_every': value {self.gap_every!r} must be an integer >= 0 "
                              "(0: never, k: every k-th step)")
        if self.wandb_table_above < 0:
            raise ConfigError(f"config key 'logging.wandb_table_above': value {self.wandb_table_above} must be >= 0")
        if self.wandb_table_every < 1:
            raise ConfigError(f"config key 'logging.wandb_table_every': value {self.wandb_table_every} must be >= 1")
