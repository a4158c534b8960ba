"""Held-out evaluation: `evaluate(rt, label)` (the driver's before / after tables) and `jointrl eval CKPT`,
held-out success per domain (and per thinking tier) for one checkpoint.

CKPT is a HF checkpoint dir (a run's `checkpoint/hf`, or any compatible model dir: with the project
tokenizer it speaks the `jointrl` chat format, with a chat template of its own the `hf` codec, unless
`model.chat_codec` says otherwise) or a shipped model shape name (random weights: a floor for comparisons).
Greedy decoding, one episode per held-out task, through the same vLLM workers, environments
and graders as training. Prints a table and writes RUN_DIR/eval_<label>.json.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rl.config import RunConfig
from rl.log import get_logger, setup_logging

log = get_logger("eval")


@dataclass(frozen=True)
class EvalRow:
    domain: str
    tier: str
    n: int
    success: float
    reward: float
    tokens: float
    turns: float
    samples: int = 1  # episodes per task; n x samples episodes in all
    task_success: tuple[float, ...] = ()  # per task (held-out order), success over its samples: for paired comparisons


def evaluate(rt: Any, label: str, n_per_domain: int | None = None, tiers: Sequence[str] | None = None) -> list[EvalRow]:
    """Held-out success per domain (and tier) through the runtime's engines (`rt`: rl.runtime.Runtime):
    `eval.samples` episodes per task at `eval.temperature`; writes RUN_DIR/eval_<label>.json."""
    ev = rt.cfg.eval
    n = n_per_domain or ev.n_per_domain or max(2, rt.cfg.trainer.tasks_per_step)
    rows: list[EvalRow] = []
    for d in rt.domains:
        for tier in tiers or (None,):
            tasks = rt.eval_tasks[d][:n]
            if tier is not None:
                from dataclasses import replace

                tasks = [replace(t, thinking=tier) for t in tasks]
            groups = rt.run_groups(tasks, ev.samples, temperature=ev.temperature, seed=ev.seed)
            eps = [e for g in groups for e in g]
            rows.append(EvalRow(domain=d, tier=tier or (tasks[0].thinking if tasks else "-"), n=len(tasks), samples=ev.samples,
                                task_success=tuple(float(np.mean([e.reward >= 1.0 for e in g])) for g in groups),
                                success=float(np.mean([e.reward >= 1.0 for e in eps])) if eps else 0.0,
                                reward=float(np.mean([e.reward for e in eps])) if eps else 0.0,
                                tokens=float(np.mean([sum(e.loss_mask) for e in eps])) if eps else 0.0,
                                turns=float(np.mean([e.num_turns for e in eps])) if eps else 0.0))
    (rt.run_dir / f"eval_{label}.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return rows

@dataclass(frozen=True)
class PairedDiff:
    """after - before over the same tasks (same order, same sampling seeds): the mean difference, its
    confidence interval from Student's t with n - 1 degrees of freedom, and the paired t statistic."""
    n: int
    mean: float
    ci_low: float
    ci_high: float
    t: float


def paired_diff(before: Sequence[float], after: Sequence[float], confidence: float = 0.95) -> PairedDiff:
    """The paired comparison of per-task success before and after (the paired t-test, e.g. Student 1908;
    any statistics text). t is +inf / -inf / 0 when every difference is equal (zero spread)."""
    from scipy.stats import t as student_t

    if len(before) != len(after):
        raise ValueError(f"paired_diff: {len(before)} tasks before vs {len(after)} after; a paired comparison needs the same tasks")
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    n = int(d.size)
    if n < 2:
        mean = float(d.mean()) if n else 0.0
        return PairedDiff(n, mean, -math.inf, math.inf, 0.0)
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        return PairedDiff(n, mean, mean, mean, math.copysign(math.inf, mean) if mean else 0.0)
    se = sd / math.sqrt(n)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * se
    return PairedDiff(n, mean, mean - half, mean + half, mean / se)


def format_eval_table(before: Sequence[EvalRow], after: Sequence[EvalRow] | None = None) -> str:
    """Per domain (and tier): success, reward, tokens and turns; with `after`, the same columns after RL
    and the paired gain in success with its 95% confidence interval and paired t."""
    head = f"{'domain':<10} {'tier':<5} {'n':>3} {'success':>8} {'reward':>7} {'tokens':>7} {'turns':>6}"
    if after is not None:
        head += f" | {'success':>8} {'reward':>7} {'tokens':>7} {'turns':>6} | {'gain':>6} {'95% CI':>15} {'t':>6}"
    lines = [head, "-" * len(head)]
    for i, b in enumerate(before):
        line = f"{b.domain:<10} {b.tier:<5} {b.n:>3} {b.success:>8.3f} {b.reward:>7.3f} {b.tokens:>7.1f} {b.turns:>6.2f}"
        if after is not None and i < len(after):
            a = after[i]
            line += f" | {a.success:>8.3f} {a.reward:>7.3f} {a.tokens:>7.1f} {a.turns:>6.2f}"
            if len(a.task_success) == len(b.task_success) and b.task_success:
                p = paired_diff(b.task_success, a.task_success)
                line += f" | {p.mean:>+6.3f} [{p.ci_low:>+6.3f},{p.ci_high:>+6.3f}] {p.t:>6.2f}"
            else:
                line += f" | {a.success - b.success:>+6.3f} {'(unpaired)':>15} {'-':>6}"
        lines.append(line)
    return "\n".join(lines)

def print_eval_table(run_dir: Path, before: Sequence[EvalRow], after: Sequence[EvalRow]) -> None:
    text = "held-out evaluation: before RL | after RL\n" + format_eval_table(before, after)
    print(text, flush=True)
    (Path(run_dir) / "eval_table.txt").write_text(text + "\n")


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
        rows = evaluate(rt, "eval", n_per_domain=tasks_per_domain, tiers=tiers)
        print(f"held-out evaluation of {checkpoint}\n" + format_eval_table(rows), flush=True)
    finally:
        rt.shutdown()
    return 0
