"""`jointrl eval CKPT`: held-out success per domain (and per thinking tier) for one checkpoint.

CKPT is a HF checkpoint dir (a run's `checkpoint/hf`, or any compatible model dir with the
project tokenizer) or a shipped model shape name (random weights: a floor for comparisons).
Greedy decoding, one episode per held-out task, through the same vLLM workers, environments
and graders as training. Prints a table and writes RUN_DIR/eval_<label>.json.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from rl.config import RunConfig
from rl.log import get_logger, setup_logging

log = get_logger("eval")


def main(cfg: RunConfig, checkpoint: str, tasks_per_domain: int = 8, tiers: Sequence[str] | None = None) -> int:
    from rl.runtime import Runtime

    setup_logging(cfg.logging.level)
    for t in tiers or ():
        if t not in ("low", "high", "max"):
            print(f"jointrl eval: unknown thinking tier {t!r}; allowed: low, high, max")
            return 2
    ck = Path(checkpoint)
    if (ck / "hf" / "config.json").exists():  # a run's checkpoint dir
        ck = ck / "hf"
    cfg = replace(cfg, name=f"eval-{ck.name}", model=replace(cfg.model, arch=str(ck) if ck.exists() else checkpoint),
                  logging=replace(cfg.logging, wandb_mode="disabled"))
    rt = Runtime.start(cfg, with_trainer=False)
    try:
        rows = rt.evaluate("eval", n_per_domain=tasks_per_domain, tiers=tiers)
        print(f"held-out evaluation of {checkpoint}\n" + rt.format_eval_table(rows), flush=True)
    finally:
        rt.shutdown()
    return 0
