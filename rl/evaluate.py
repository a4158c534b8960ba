"""Held-out evaluation: `evaluate(rollouts, pools, ev, run_dir, label)` (the driver's before / after tables)
and `jointrl eval CKPT`, held-out success per domain (and per thinking tier) for one checkpoint.

CKPT is read as every model argument is (rl/model_arg.py): a HF checkpoint dir (a run's `checkpoint` or
`checkpoint/hf`, or any compatible model dir: with the project tokenizer it speaks the `jointrl` chat format,
with a chat template of its own the `hf` codec, unless `model.chat_codec` says otherwise), a pullable
model's name (pulled on first use, as `jointrl train` pulls `model.arch`), a URL of exported weights, or a
shipped model shape name (random weights: a floor for comparisons).
`eval.samples` episodes per held-out task at `eval.temperature`, through the same vLLM workers,
environments and graders as training. Prints a table and writes RUN_DIR/eval_<label>.json.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rl.config import EvalSection, RunConfig
from rl.eval_plan import plan_for_run
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


def evaluate(rollouts: Any, pools: Any, ev: EvalSection, run_dir: Path, label: str, *, default_n: int, weights: Mapping[str, float],
             n_per_domain: int | None = None, tiers: Sequence[str] | None = None) -> list[EvalRow]:
    """Held-out success per domain (and tier) of `pools` (rl.tasks.TaskPools) through `rollouts`
    (rl.rollout.rollouts.Rollouts) under the `eval` section `ev`: `eval.samples` episodes per task at
    `eval.temperature`, on `n_per_domain`, else `eval.n_per_domain`, else `default_n` tasks per domain, or the
    plan fitted to `eval.budget_episodes` over the domains and their `weights`; writes RUN_DIR/eval_<label>.json."""
    import time

    from rl.log import progress

    n = n_per_domain or ev.n_per_domain or default_n
    plan = plan_for_run(pools, ev, weights).tasks if n_per_domain is None and ev.budget_episodes else None  # to fit the budget
    rows: list[EvalRow] = []
    per_domain = {d: len(pools.heldout[d][:plan[d] if plan is not None else n]) for d in pools.domains}
    total = sum(per_domain.values()) * len(tiers or (None,)) * ev.samples
    log.info("held-out evaluation %r: %d episodes over %d domain(s)", label, total, sum(1 for v in per_domain.values() if v))
    t0 = time.perf_counter()
    bar = progress(desc=f"eval {label}", total=total, unit="ep")
    watched = _EpisodeCounter(rollouts, bar)
    for d in pools.domains:
        if plan is not None and plan[d] == 0:
            continue
        for tier in tiers or (None,):
            tasks = pools.heldout[d][:plan[d] if plan is not None else n]
            if tier is not None:
                from dataclasses import replace

                tasks = [replace(t, thinking=tier) for t in tasks]
            bar.set_postfix_str(f"{d}{f' ({tier})' if tier else ''}")
            with watched:
                groups = rollouts.run_groups(tasks, ev.samples, temperature=ev.temperature, seed=ev.seed)
            eps = [e for g in groups for e in g]
            rows.append(EvalRow(domain=d, tier=tier or (tasks[0].thinking if tasks else "-"), n=len(tasks), samples=ev.samples,
                                task_success=tuple(float(np.mean([e.reward >= 1.0 for e in g])) for g in groups),
                                success=float(np.mean([e.reward >= 1.0 for e in eps])) if eps else 0.0,
                                reward=float(np.mean([e.reward for e in eps])) if eps else 0.0,
                                tokens=float(np.mean([sum(e.loss_mask) for e in eps])) if eps else 0.0,
                                turns=float(np.mean([e.num_turns for e in eps])) if eps else 0.0))
    bar.close()
    log.info("held-out evaluation %r: %d episodes in %.0f s", label, watched.finished, time.perf_counter() - t0)
    (Path(run_dir) / f"eval_{label}.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return rows


class _EpisodeCounter:
    """While entered, every environment the rollouts make advances `bar` by one when it closes (each episode
    closes its environment once, however it ended), so the evaluation's bar moves per finished episode and
    its ETA is the rate of finished episodes. Plain progress logging: it changes nothing about the episodes."""

    def __init__(self, rollouts: Any, bar: Any) -> None:
        self.rollouts, self.bar, self.finished = rollouts, bar, 0

    def __enter__(self) -> "_EpisodeCounter":
        make = getattr(self.rollouts, "make_env", None)
        self._own, self._counting = vars(self.rollouts).get("make_env"), make is not None
        if make is None:  # rollouts that make no environments here (a test double): nothing to count
            return self  # a rollouts object may hold make_env as an attribute of its own

        def make_env(task):
            env = make(task)
            close = env.close
            seen = []

            def counted_close() -> None:
                try:
                    close()
                finally:
                    if not seen:
                        seen.append(True)
                        self.finished += 1
                        self.bar.update(1)

            env.close = counted_close
            return env

        self.rollouts.make_env = make_env  # an instance attribute over the method, removed on exit
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._counting:
            return
        if self._own is not None:
            self.rollouts.make_env = self._own
        else:
            del self.rollouts.make_env


def load_eval(run_dir: Path, label: str) -> list[EvalRow] | None:
    """The rows `evaluate(rollouts, pools, ev, run_dir, label)` wrote to RUN_DIR/eval_<label>.json, or None if there is no such file."""
    path = Path(run_dir) / f"eval_{label}.json"
    if not path.exists():
        return None
    return [EvalRow(**{**r, "task_success": tuple(r["task_success"])}) for r in json.loads(path.read_text())]

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


def format_eval_table(before: Sequence[EvalRow], after: Sequence[EvalRow] | None = None,
                      control: Sequence[EvalRow] | None = None) -> str:
    """Per domain (and tier): success, reward, tokens and turns; with `after`, the same columns after RL
    and the paired gain in success with its 95% confidence interval and paired t; with `control` (the SFT
    control arm), its success and the paired gain of RL over it."""
    head = f"{'domain':<16} {'tier':<5} {'n':>4} {'success':>8} {'reward':>7} {'tokens':>7} {'turns':>6}"
    if after is not None:
        head += f" | {'success':>8} {'reward':>7} {'tokens':>7} {'turns':>6} | {'gain':>6} {'95% CI':>15} {'t':>6}"
    if control is not None:
        head += f" | {'sft ctl':>8} {'RL-ctl':>7} {'t':>6}"
    lines = [head, "-" * len(head)]
    ctl_by = {(c.domain, c.tier): c for c in control or ()}
    for i, b in enumerate(before):
        line = f"{b.domain:<16} {b.tier:<5} {b.n:>4} {b.success:>8.3f} {b.reward:>7.3f} {b.tokens:>7.1f} {b.turns:>6.2f}"
        a = after[i] if after is not None and i < len(after) else None
        if a is not None:
            line += f" | {a.success:>8.3f} {a.reward:>7.3f} {a.tokens:>7.1f} {a.turns:>6.2f}"
            if len(a.task_success) == len(b.task_success) and b.task_success:
                p = paired_diff(b.task_success, a.task_success)
                line += f" | {p.mean:>+6.3f} [{p.ci_low:>+6.3f},{p.ci_high:>+6.3f}] {p.t:>6.2f}"
            else:
                line += f" | {a.success - b.success:>+6.3f} {'(unpaired)':>15} {'-':>6}"
        c = ctl_by.get((b.domain, b.tier))
        if control is not None and a is not None and c is not None:
            if len(c.task_success) == len(a.task_success) and a.task_success:
                q = paired_diff(c.task_success, a.task_success)
                line += f" | {c.success:>8.3f} {q.mean:>+7.3f} {q.t:>6.2f}"
            else:
                line += f" | {c.success:>8.3f} {a.success - c.success:>+7.3f} {'-':>6}"
        lines.append(line)
    return "\n".join(lines)

def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Confidence interval of the mean of per-task success (Student's t over tasks, n - 1 degrees of
    freedom): the same model of the data as `paired_diff`, one arm alone. (-inf, inf) below two tasks."""
    from scipy.stats import t as student_t

    x = np.asarray(values, dtype=np.float64)
    n = int(x.size)
    if n < 2:
        return (-math.inf, math.inf)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    return (float(x.mean()) - half, float(x.mean()) + half)


def tasks_to_resolve(sd_diff: float, gain: float, t: float = 3.0) -> int:
    """Held-out tasks a paired comparison needs so that a true mean gain `gain` reaches paired t >= `t`,
    given the standard deviation `sd_diff` of the per-task differences (after - before) measured on an
    earlier run: t = gain / (sd_diff / sqrt(n))  =>  n = (t x sd_diff / gain)^2, rounded up. This is the
    expected t at the true gain (no power margin): half of such runs land below t."""
    if gain <= 0 or sd_diff < 0:
        raise ValueError(f"tasks_to_resolve: gain must be > 0 and sd_diff >= 0 (got gain={gain}, sd_diff={sd_diff})")
    return max(2, math.ceil((t * sd_diff / gain) ** 2))


@dataclass(frozen=True)
class EnvResult:
    """One environment's held-out comparison, as written to eval.json (the quickstart's contract)."""

    n: int
    success_before: float
    success_after: float
    ci95_before: tuple[float, float]
    ci95_after: tuple[float, float]
    paired_t: float
    gain: float
    gain_ci95: tuple[float, float]
    samples: int


def compare(before: Sequence[EvalRow], after: Sequence[EvalRow]) -> list[tuple[EvalRow, EnvResult]]:
    """Pair each before-row with its after-row (same domain and tier) into an `EnvResult`."""
    after_by = {(a.domain, a.tier): a for a in after}
    out = []
    for b in before:
        a = after_by.get((b.domain, b.tier))
        if a is None:
            continue
        p = paired_diff(b.task_success, a.task_success)
        out.append((b, EnvResult(n=b.n, success_before=b.success, success_after=a.success, ci95_before=mean_ci(b.task_success),
                                 ci95_after=mean_ci(a.task_success), paired_t=p.t, gain=p.mean, gain_ci95=(p.ci_low, p.ci_high),
                                 samples=b.samples)))
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf: an undefined interval or t is null


def write_eval_json(path: Path, env_ids: dict[str, str], before: Sequence[EvalRow], after: Sequence[EvalRow],
                    control: Sequence[EvalRow] | None = None, rl_seconds: float | None = None) -> dict:
    """Write `eval_doc(...)` to `path` and return it."""
    doc = eval_doc(env_ids, before, after, control, rl_seconds)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def eval_doc(env_ids: dict[str, str], before: Sequence[EvalRow], after: Sequence[EvalRow],
             control: Sequence[EvalRow] | None = None, rl_seconds: float | None = None) -> dict:
    """`{"domains": {ENV_ID: {n, success_before, success_after, ci95_before, ci95_after, paired_t, ...}}}`, one
    entry per evaluated environment id (`env_ids`: the run's domain key -> environment id). With several tiers
    of one environment the id is suffixed `@tier`. With the SFT control arm, each entry also has
    `success_sft_control`, `ci95_sft_control` and `paired_t_rl_vs_sft_control`. With `rl_seconds` (RL's wall
    time), the top level has it and each entry `points_per_10min`: held-out points gained per 10 minutes of RL."""
    pairs = compare(before, after)
    ctl = {(r.domain, r.tier): (r, res) for r, res in compare(control, after)} if control else {}
    ctl_rows = {(c.domain, c.tier): c for c in control or ()}
    tiers: dict[str, set[str]] = {}
    for b, _ in pairs:
        tiers.setdefault(b.domain, set()).add(b.tier)
    doc: dict = {"domains": {}}
    if rl_seconds is not None:
        doc["rl_seconds"] = rl_seconds
    for b, r in pairs:
        key = env_ids.get(b.domain, b.domain) + (f"@{b.tier}" if len(tiers[b.domain]) > 1 else "")
        doc["domains"][key] = {"domain": b.domain, "tier": b.tier, "n": r.n, "samples": r.samples,
                               "success_before": r.success_before, "success_after": r.success_after,
                               "ci95_before": [_finite(x) for x in r.ci95_before], "ci95_after": [_finite(x) for x in r.ci95_after],
                               "paired_t": _finite(r.paired_t), "gain": r.gain, "gain_ci95": [_finite(x) for x in r.gain_ci95]}
        if rl_seconds:
            doc["domains"][key]["points_per_10min"] = 100.0 * r.gain / (rl_seconds / 600.0)
        if (b.domain, b.tier) in ctl:
            c, rc = ctl[(b.domain, b.tier)]  # compare(control, after): "before" = the control arm
            doc["domains"][key].update({"success_sft_control": c.success,
                                        "ci95_sft_control": [_finite(x) for x in mean_ci(ctl_rows[(b.domain, b.tier)].task_success)],
                                        "gain_rl_vs_sft_control": rc.gain, "paired_t_rl_vs_sft_control": _finite(rc.paired_t)})
    return doc


def print_eval_table(run_dir: Path, before: Sequence[EvalRow], after: Sequence[EvalRow], env_ids: dict[str, str] | None = None,
                     control: Sequence[EvalRow] | None = None, rl_seconds: float | None = None, sft: bool = True) -> None:
    """Print the before/after (| SFT control) table; write RUN_DIR/eval_table.txt and RUN_DIR/eval.json.
    `sft`: whether a supervised warm start ran before the "before" evaluation (it names the column)."""
    title = ("held-out evaluation: before RL" + (" (after SFT)" if sft else "") + " | after RL"
             + (" | SFT continued for RL's wall time" if control else ""))
    text = title + "\n" + format_eval_table(before, after, control)
    print(text, flush=True)
    (Path(run_dir) / "eval_table.txt").write_text(text + "\n")
    write_eval_json(Path(run_dir) / "eval.json", env_ids or {}, before, after, control, rl_seconds)


def eval_model(checkpoint: str, *, pull: bool = True) -> tuple[str, str]:
    """`jointrl eval`'s CKPT read as every model argument is (rl/model_arg.py; a pullable name is pulled as
    `jointrl train` pulls `model.arch`): the run's `model.arch` and the label of its run name. A shipped config
    keeps its name, so the run builds its random weights with `model.seed`."""
    from rl.model_arg import resolve_model

    arg = resolve_model(checkpoint, pull=pull, what="jointrl eval CKPT")
    arch = str(arg.path) if arg.path is not None else checkpoint
    return arch, (arg.path.name if arg.kind == "checkpoint" else Path(checkpoint.rstrip("/")).name)


def main(cfg: RunConfig, checkpoint: str, tasks_per_domain: int = 8, tiers: Sequence[str] | None = None) -> int:
    from rl.model_arg import ModelArgError
    from rl.rollout.tiers import TIERS
    from rl.setup import start_run

    setup_logging(cfg.logging.level)
    for t in tiers or ():
        if t not in TIERS:
            print(f"jointrl eval: unknown thinking tier {t!r}; allowed: {', '.join(TIERS)}")
            return 2
    try:
        arch, label = eval_model(checkpoint)
    except ModelArgError as e:
        print(f"jointrl eval: {e}", file=sys.stderr)
        return 2
    cfg = replace(cfg, name=f"eval-{label}", model=replace(cfg.model, arch=arch),
                  logging=replace(cfg.logging, wandb_mode="disabled"))
    with start_run(cfg, with_trainer=False) as parts:
        rows = evaluate(parts.rollouts, parts.pools, cfg.eval, parts.run_dir, "eval", default_n=max(2, cfg.trainer.tasks_per_step),
                        weights=cfg.envs.weights, n_per_domain=tasks_per_domain, tiers=tiers)
        print(f"held-out evaluation of {checkpoint}\n" + format_eval_table(rows), flush=True)
    return 0
