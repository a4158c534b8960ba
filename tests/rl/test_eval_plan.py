"""rl/eval_plan.py: the budgeted, family-stratified held-out plan and the per-family figures, against slow
references written from the formulas; eval.budget_episodes validated and shown to change what evaluate runs."""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from jointrl.records import Message, Task
from rl.config import ConfigError, RunConfig, load_config
from rl.eval_plan import family_summary, plan_eval, stratified_mean, write_family_summary
from rl.evaluate import EvalRow, evaluate

FAMS = {"arith": 6, "logic": 3, "games": 1}  # family -> domains


def _world(pool: int = 20):
    family_of = {f"{f}-{i}": f for f, n in FAMS.items() for i in range(n)}
    return {d: pool for d in family_of}, family_of


def test_every_domain_gets_a_task_and_families_share_the_rest_evenly():
    pools, fam = _world()
    p = plan_eval(2 * 40, 2, pools, fam, {}, seed=0)  # 40 tasks over 10 domains
    assert sum(p.tasks.values()) == 40 and p.episodes == 80
    assert min(p.tasks.values()) >= 1
    per_fam = {f: sum(p.tasks[d] for d in p.tasks if fam[d] == f) for f in FAMS}
    # 10 floors, then 30 split evenly: 10 more per family
    assert per_fam == {"arith": 6 + 10, "logic": 3 + 10, "games": 1 + 10}
    # inside a family, equal weights: counts differ by at most one
    arith = [p.tasks[d] for d in p.tasks if fam[d] == "arith"]
    assert max(arith) - min(arith) <= 1


def test_inside_a_family_tasks_follow_the_base_weights():
    pools, fam = _world(pool=100)
    w = {"arith-0": 3.0, "arith-1": 1.0}  # the others weigh 1 (absent)
    p = plan_eval(10 + 3 * 24, 1, pools, fam, w, seed=0)
    # arith: 6 floors + 24 extra by weight 3:1:1:1:1:1 (sum 8) -> 9, 3, 3, 3, 3, 3
    assert p.tasks["arith-0"] == 1 + 9 and all(p.tasks[f"arith-{i}"] == 1 + 3 for i in range(1, 6))


def test_small_pools_cap_and_the_rest_moves_to_the_others():
    pools, fam = _world(pool=20)
    pools["games-0"] = 4  # this family can take only 4 tasks in all
    p = plan_eval(40, 1, pools, fam, {}, seed=1)
    assert p.tasks["games-0"] == 4
    assert sum(p.tasks.values()) == 40 and all(p.tasks[d] <= pools[d] for d in p.tasks)
    per_fam = {f: sum(p.tasks[d] for d in p.tasks if fam[d] == f) for f in FAMS}
    assert per_fam["arith"] - per_fam["logic"] in (3, 2, 4)  # both got what games could not take, evenly
    # a budget larger than every pool: each domain runs its whole held-out split
    full = plan_eval(10_000, 1, pools, fam, {}, seed=1)
    assert full.tasks == pools


def test_under_one_task_per_domain_every_family_comes_first():
    pools, fam = _world()
    p = plan_eval(3, 1, pools, fam, {}, seed=5)
    assert sum(p.tasks.values()) == 3 and set(p.families) == set(FAMS)
    p5 = plan_eval(5, 1, pools, fam, {}, seed=5)
    chosen = [d for d, n in p5.tasks.items() if n]
    assert len(chosen) == 5 and {fam[d] for d in chosen} == set(FAMS)
    # the seed decides which domains; the same seed, the same plan
    assert plan_eval(5, 1, pools, fam, {}, seed=5) == p5
    picks = {tuple(sorted(d for d, n in plan_eval(5, 1, pools, fam, {}, seed=s).tasks.items() if n)) for s in range(20)}
    assert len(picks) > 1
    # episodes the budget cannot fill as whole tasks are left out, not overspent
    assert plan_eval(7, 2, pools, fam, {}, seed=0).episodes == 6


def test_at_500_domains_the_plan_fits_the_budget():
    fam = {f"rg-{i}": f"f{i % 12}" for i in range(500)}
    pools = {d: 5 + i % 40 for i, d in enumerate(fam)}
    p = plan_eval(1000, 1, pools, fam, {}, seed=0)
    assert p.episodes == 1000 and min(p.tasks.values()) == 1
    assert all(p.tasks[d] <= pools[d] for d in p.tasks)


def _stratified_reference(values, weights):
    """Cochran's stratified mean and variance written out with loops (pooled within-stratum variance)."""
    doms = list(values)
    wsum = sum(weights.get(d, 0.0) or 1.0 for d in doms)
    W = {d: (weights.get(d, 0.0) or 1.0) / wsum for d in doms}
    mean = 0.0
    for d in doms:
        mean += W[d] * (sum(values[d]) / len(values[d]))
    ss, N = 0.0, 0
    for d in doms:
        m = sum(values[d]) / len(values[d])
        for y in values[d]:
            ss += (y - m) ** 2
            N += 1
    s2 = ss / (N - len(doms))
    var = 0.0
    for d in doms:
        var += W[d] ** 2 * s2 / len(values[d])
    return mean, math.sqrt(var), N - len(doms)


def test_stratified_mean_matches_the_formula_and_a_t_interval():
    from scipy.stats import t as student_t

    rng = np.random.default_rng(3)
    values = {d: list(rng.integers(0, 2, size=n).astype(float)) for d, n in {"a": 5, "b": 2, "c": 9}.items()}
    weights = {"a": 2.0, "b": 1.0}
    est = stratified_mean(values, weights)
    mean, se, df = _stratified_reference(values, weights)
    assert est.mean == pytest.approx(mean) and est.se == pytest.approx(se) and est.df == df
    half = student_t.ppf(0.975, df) * se
    assert (est.ci_low, est.ci_high) == pytest.approx((mean - half, mean + half))


def test_one_task_per_domain_falls_back_to_the_spread_of_all_values():
    est = stratified_mean({"a": [1.0], "b": [0.0], "c": [1.0]}, {})
    assert est.mean == pytest.approx(2 / 3) and est.df == 2
    s2 = np.var([1.0, 0.0, 1.0], ddof=1)
    assert est.se == pytest.approx(math.sqrt(3 * (1 / 3) ** 2 * s2))
    single = stratified_mean({"a": [1.0]}, {})
    assert single.mean == 1.0 and single.ci_low == -math.inf


def _row(d, ts):
    return EvalRow(domain=d, tier="-", n=len(ts), success=float(np.mean(ts)), reward=0.0, tokens=0.0, turns=0.0,
                   task_success=tuple(ts))


def test_family_summary_pairs_tasks_and_writes_json_and_table(tmp_path):
    fam = {"a": "F", "b": "F", "c": "G"}
    before = [_row("a", [0, 0, 1]), _row("b", [0, 1]), _row("c", [1, 1])]
    after = [_row("a", [1, 0, 1]), _row("b", [1, 1]), _row("c", [1, 1])]
    rows = family_summary(fam, {}, before, after)
    f = next(r for r in rows if r.family == "F")
    assert f.domains == 2 and f.tasks == 5 and f.success == pytest.approx(0.5 * (1 / 3) + 0.5 * 0.5)
    ref = stratified_mean({"a": [1, 0, 0], "b": [1, 0]}, {})
    assert (f.gain, f.gain_ci_low, f.gain_ci_high) == pytest.approx((ref.mean, ref.ci_low, ref.ci_high))
    (tmp_path / "eval_table.txt").write_text("per-domain table\n")
    path = write_family_summary(tmp_path, fam, {}, before, after)
    import json

    doc = json.loads(path.read_text())
    assert [r["family"] for r in doc] == ["F", "G"] and doc[1]["ci_low"] == doc[1]["ci_high"] == 1.0  # G: equal values, se 0
    assert "per family" in (tmp_path / "eval_table.txt").read_text()
    # every family a single domain: nothing to add to the per-domain table
    assert write_family_summary(tmp_path, {"a": "a", "c": "c"}, {}, before[:1], after[:1]) is None


@pytest.mark.parametrize("override,needles", [
    ("eval.budget_episodes=-1", ["eval.budget_episodes", "-1", ">= 0"]),
    ("eval.budget_episodes=1", ["eval.budget_episodes", "eval.samples=2"]),
    ("eval.n_per_domain=4", ["eval.budget_episodes", "eval.n_per_domain", "set one"]),
])
def test_bad_budgets_name_the_key(override, needles):
    base = ["eval.samples=2", "eval.temperature=1.0", "eval.budget_episodes=8"]
    with pytest.raises(ConfigError) as ei:
        load_config(None, base + [override])
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))
    assert load_config(None, base).eval.budget_episodes == 8


def _fake_run(tmp_path, budget: int):
    """`evaluate` over fake pools whose rollouts count the tasks they run; (run(label), pools, counts)."""
    fam = {f"{f}{i}": f for f, n in (("x", 4), ("y", 1)) for i in range(n)}
    mk = lambda d, i, split: Task(id=f"{d}-{split}-{i}", domain=d, prompt=(Message(role="user", content="q"),),
                                  public={"family": fam[d]})
    cfg = RunConfig()
    cfg = replace(cfg, eval=replace(cfg.eval, budget_episodes=budget, n_per_domain=0 if budget else 3))
    ran: dict[str, int] = {}

    def run_groups(tasks, samples, temperature, seed):
        for t in tasks:
            ran[t.domain] = ran.get(t.domain, 0) + 1
        return [[SimpleNamespace(reward=1.0, loss_mask=(1,), num_turns=1)] * samples for _ in tasks]

    pools = SimpleNamespace(domains=tuple(sorted(fam)), env_ids={d: d for d in fam}, train={d: [mk(d, 0, "train")] for d in fam},
                            heldout={d: [mk(d, i, "heldout") for i in range(10)] for d in fam})
    rollouts = SimpleNamespace(run_groups=run_groups)
    return (lambda label: evaluate(rollouts, pools, cfg.eval, tmp_path, label, default_n=2, weights=cfg.envs.weights)), pools, ran


def test_the_budget_changes_what_evaluate_runs(tmp_path):
    run, pools, ran = _fake_run(tmp_path, budget=0)
    run("before")
    assert ran == {d: 3 for d in pools.domains}  # eval.n_per_domain everywhere
    run, pools, ran = _fake_run(tmp_path, budget=12)
    rows = run("before")
    # 12 tasks: 5 floors, 7 more split evenly over families x and y (y's one domain takes 3 or 4 more)
    assert sum(ran.values()) == 12 and min(ran.values()) >= 1 and ran["y0"] in (4, 5)
    assert {r.domain: r.n for r in rows} == ran
    run, pools, ran = _fake_run(tmp_path, budget=2)
    run("before")
    assert sum(ran.values()) == 2 and {d[0] for d in ran} == {"x", "y"}  # under one per domain: both families first
