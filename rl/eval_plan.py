"""Held-out evaluation that fits a budget at hundreds of domains: which domains get how many tasks, and the
per-family figures with confidence intervals.

`plan_eval` splits `eval.budget_episodes` episodes (so budget // eval.samples tasks) over the run's domains:
1. every domain with held-out tasks gets one task, when the budget has that many; when it has fewer, the
   tasks go round-robin over families (families, and the domains inside each, in an order drawn from the
   seed), so every family is seen before any family gets a second domain;
2. the rest is split evenly across families, then inside a family in proportion to the domains' base
   weights (`envs.weights`), each by largest remainder with the seed's order breaking ties; a domain never
   gets more tasks than its held-out split has, and what a full domain (or family) cannot take goes to the
   others.
The same seed, domains, weights and pool sizes give the same plan, so the before, after and control arms
of one run evaluate the same tasks (the first n of each domain's held-out list) and stay paired.

`family_summary` turns the per-domain rows into per-family figures: the stratified mean (Cochran,
"Sampling Techniques", 3rd ed., sec. 5.2-5.3: ȳ_st = Σ_h W_h ȳ_h, V(ȳ_st) = Σ_h W_h² s_h² / n_h, finite-
population correction left out) with W_h the domain's share of the family's base weight, and a Student-t
interval. s_h² is the family's pooled within-domain variance of per-task success (one task per domain
gives no within-domain variance; then the variance of all the family's task values, which also holds the
between-domain spread and so errs wide). With before and after rows, the same estimator on the per-task
differences gives each family's paired gain and its interval.

It does not run episodes (rl/evaluate.py does, through the run's rollouts) or choose the budget.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from rl.algos.apportion import largest_remainder

if TYPE_CHECKING:
    from rl.config import EvalSection


@dataclass(frozen=True)
class EvalPlan:
    """Held-out tasks per domain for one evaluation arm (`tasks[d]` = 0: the domain is not evaluated)."""

    tasks: Mapping[str, int]
    samples: int                 # episodes per task
    budget_episodes: int
    families: Mapping[str, tuple[str, ...]]  # family -> its domains, as planned

    @property
    def episodes(self) -> int:
        return sum(self.tasks.values()) * self.samples


def _fill(total: int, weights: Mapping[str, float], room: Mapping[str, int], rank: Mapping[str, int]) -> dict[str, int]:
    """Split `total` by weight, no key above its `room`; what a full key cannot take goes to the others
    (rounds of largest remainder over the keys with room left)."""
    got = {k: 0 for k in weights}
    left = min(total, sum(room.values()))
    while left > 0:
        open_ = {k: w for k, w in weights.items() if got[k] < room[k] and w > 0}
        if not open_:
            break
        share = largest_remainder(left, open_, rank)
        moved = 0
        for k, n in share.items():
            take = min(n, room[k] - got[k])
            got[k] += take
            moved += take
        left -= moved
        if moved == 0:  # every share rounded to 0 among keys with room: give one to the first by rank
            k = min(open_, key=lambda k: rank[k])
            got[k] += 1
            left -= 1
    return got


def plan_eval(budget_episodes: int, samples: int, pool_sizes: Mapping[str, int], family_of: Mapping[str, str],
              weights: Mapping[str, float], seed: int) -> EvalPlan:
    """The plan (see the module docstring). pool_sizes: held-out tasks each domain has; family_of: domain ->
    family (the run record's); weights: base sampling weights (a domain missing there or at 0 weighs 1:
    every domain is evaluated, trained on or not)."""
    if budget_episodes <= 0 or samples <= 0:
        raise ValueError(f"plan_eval: budget_episodes and samples must be > 0 (got {budget_episodes}, {samples})")
    budget_tasks = budget_episodes // samples
    doms = sorted(d for d, n in pool_sizes.items() if n > 0)
    rng = random.Random(seed)
    fams: dict[str, list[str]] = {}
    for d in doms:
        fams.setdefault(family_of.get(d, d), []).append(d)
    fam_order = sorted(fams)
    rng.shuffle(fam_order)
    for f in fam_order:
        rng.shuffle(fams[f])
    fam_rank = {f: i for i, f in enumerate(fam_order)}
    dom_rank = {d: i for i, d in enumerate(d for f in fam_order for d in fams[f])}
    tasks = {d: 0 for d in pool_sizes}
    if budget_tasks < len(doms):
        # Round-robin over families: family i's j-th domain comes in round j.
        order = [fams[f][j] for j in range(max((len(v) for v in fams.values()), default=0)) for f in fam_order if j < len(fams[f])]
        for d in order[:budget_tasks]:
            tasks[d] = 1
    else:
        for d in doms:
            tasks[d] = 1
        rest = budget_tasks - len(doms)
        room_f = {f: sum(pool_sizes[d] - 1 for d in fams[f]) for f in fams}
        per_fam = _fill(rest, {f: 1.0 for f in fams}, room_f, fam_rank)
        for f, n in per_fam.items():
            w = {d: (weights.get(d, 0.0) or 1.0) for d in fams[f]}
            extra = _fill(n, w, {d: pool_sizes[d] - 1 for d in fams[f]}, dom_rank)
            for d, k in extra.items():
                tasks[d] += k
    planned = {f: tuple(sorted(d for d in v if tasks[d] > 0)) for f, v in sorted(fams.items())}
    return EvalPlan(tasks=tasks, samples=samples, budget_episodes=budget_episodes,
                    families={f: v for f, v in planned.items() if v})


def plan_for_run(pools: Any, ev: EvalSection, weights: Mapping[str, float]) -> EvalPlan:
    """The plan for a run's task pools (`pools`: rl.tasks.TaskPools) under the `eval` section's `budget_episodes`
    (`ev`), with the run's `envs.weights`: its families from the run record's grouping of the pools' env ids."""
    from rl.observe.record import RunRecord

    family_of = RunRecord.of(pools.env_ids, pools.train, steps=0).family_of()  # families do not depend on the steps
    return plan_eval(ev.budget_episodes, ev.samples, {d: len(pools.heldout[d]) for d in pools.domains}, family_of,
                     weights, ev.seed)


# ---------------------------------------------------------------------------------------------- per-family figures
@dataclass(frozen=True)
class FamilyEstimate:
    """A stratified mean over a family's domains and its Student-t confidence interval."""

    mean: float
    ci_low: float
    ci_high: float
    se: float
    df: int


def stratified_mean(values: Mapping[str, Sequence[float]], weights: Mapping[str, float],
                    confidence: float = 0.95) -> FamilyEstimate:
    """values: domain -> per-task values; weights: domain -> weight (normalised here over the domains with
    values). See the module docstring for the estimator and the variance it uses."""
    from scipy.stats import t as student_t

    doms = [d for d, v in values.items() if len(v) > 0]
    if not doms:
        raise ValueError("stratified_mean: no domain has values")
    W = np.array([weights.get(d, 0.0) or 1.0 for d in doms], dtype=np.float64)
    W = W / W.sum()
    ys = [np.asarray(values[d], dtype=np.float64) for d in doms]
    n = np.array([y.size for y in ys], dtype=np.float64)
    mean = float(sum(w * y.mean() for w, y in zip(W, ys)))
    N, H = int(n.sum()), len(doms)
    if N - H >= 1:
        s2 = float(sum(((y - y.mean()) ** 2).sum() for y in ys)) / (N - H)
        df = N - H
    elif N >= 2:
        allv = np.concatenate(ys)
        s2, df = float(allv.var(ddof=1)), N - 1
    else:
        return FamilyEstimate(mean, -math.inf, math.inf, math.inf, 0)
    se = math.sqrt(float((W ** 2 * s2 / n).sum()))
    half = float(student_t.ppf(0.5 + confidence / 2, df)) * se
    return FamilyEstimate(mean, mean - half, mean + half, se, df)


@dataclass(frozen=True)
class FamilyRow:
    """One family's held-out figures for one arm, and with `after` the paired gain."""

    family: str
    domains: int
    tasks: int
    success: float
    ci_low: float
    ci_high: float
    gain: float | None = None
    gain_ci_low: float | None = None
    gain_ci_high: float | None = None


def family_summary(family_of: Mapping[str, str], weights: Mapping[str, float], before: Sequence, after: Sequence | None = None
                   ) -> list[FamilyRow]:
    """Per-family rows from rl.evaluate's EvalRows (`domain`, `task_success`): `before`'s success with its
    interval and, with `after` over the same tasks, the gain after - before with its interval."""
    by_fam: dict[str, list] = {}
    for r in before:
        if r.task_success:
            by_fam.setdefault(family_of.get(r.domain, r.domain), []).append(r)
    after_by = {(a.domain, a.tier): a for a in after or ()}
    out = []
    for fam in sorted(by_fam):
        rows = by_fam[fam]
        keyed = {f"{r.domain}@{r.tier}": r for r in rows}
        w = {k: weights.get(r.domain, 0.0) for k, r in keyed.items()}
        est = stratified_mean({k: r.task_success for k, r in keyed.items()}, w)
        gain = None
        diffs = {k: np.asarray(a.task_success) - np.asarray(r.task_success) for k, r in keyed.items()
                 if (a := after_by.get((r.domain, r.tier))) is not None and len(a.task_success) == len(r.task_success)}
        if after is not None and diffs:
            gain = stratified_mean(diffs, w)
        out.append(FamilyRow(fam, len({r.domain for r in rows}), sum(len(r.task_success) for r in rows), est.mean,
                             est.ci_low, est.ci_high, gain.mean if gain else None, gain.ci_low if gain else None,
                             gain.ci_high if gain else None))
    return out


def format_family_table(rows: Sequence[FamilyRow]) -> str:
    head = f"{'family':<16} {'domains':>7} {'tasks':>6} {'success':>8} {'95% CI':>15} | {'gain':>6} {'95% CI':>15}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r.family:<16} {r.domains:>7} {r.tasks:>6} {r.success:>8.3f} [{r.ci_low:>+6.3f},{r.ci_high:>+6.3f}]"
        if r.gain is not None:
            line += f" | {r.gain:>+6.3f} [{r.gain_ci_low:>+6.3f},{r.gain_ci_high:>+6.3f}]"
        lines.append(line)
    return "\n".join(lines)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None  # JSON has no inf: an undefined interval is null


def write_family_summary(run_dir: str | Path, family_of: Mapping[str, str], weights: Mapping[str, float],
                         before: Sequence, after: Sequence | None = None) -> Path | None:
    """`family_summary` written to RUN_DIR/eval_families.json (one object per family; `jointrl report` shows it
    with the other eval_*.json) and appended as a table to RUN_DIR/eval_table.txt; returns the JSON path.
    Writes nothing (None) when no family has two evaluated domains: the per-domain table already says it all."""
    rows = family_summary(family_of, weights, before, after)
    if all(r.domains < 2 for r in rows):
        return None
    rd = Path(run_dir)
    doc = [{k: (_finite(v) if isinstance(v, float) or v is None else v) for k, v in asdict(r).items()} for r in rows]
    path = rd / "eval_families.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    text = "held-out evaluation per family (stratified over domains, 95% CI)\n" + format_family_table(rows)
    print(text, flush=True)
    with open(rd / "eval_table.txt", "a", encoding="utf-8") as f:
        f.write("\n" + text + "\n")
    return path
