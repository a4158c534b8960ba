"""Benchmark the joint loop's per-domain machinery as the number of domains grows, figures side by side.

1. Driver overhead per step at 4, 100 and 500 domains with the same batch (64 tasks x 4 samples, 256
   episodes): sampler (sample + adaptive observe, learnability and DUMP), per-domain zero-variance
   accounting (rl.train.dynamic_sampling), per-domain loss normalisation (rl.algos aggregation
   `domain_token_mean` weights), telemetry (rl.observe.telemetry.rollout_metrics and the expert x domain matrix,
   rl.observe.moe), and logging (MetricsSink to JSONL), in ms, median of reps. The ratio that matters
   is step time at 500 domains over step time at 4: a step = the measured tiny-model step time
   (README: 5.38 s, `scripts/bench_train.py --breakdown`, passed as --step-s) + this overhead.
2. `jointrl report` at 500 synthetic domains: load + render time and file size.

The episodes are synthetic (no model, no environments); everything downstream of them is the real code.

Run: .venv/bin/python scripts/bench_domains.py [--quick] [--step-s 5.38]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl.algos.aggregation import aggregation_weights  # noqa: E402
from rl.observe.moe import moe_telemetry, token_domain_ids  # noqa: E402
from rl.observe.record import DomainInfo, RunRecord, write_run_record  # noqa: E402
from rl.observe.sink import MetricsSink  # noqa: E402
from rl.sampler import DomainSampler  # noqa: E402
from rl.observe.telemetry import rollout_metrics  # noqa: E402
from rl.train import dynamic_sampling  # noqa: E402
from rl.types import Episode, RolloutGroup, StepMetrics  # noqa: E402

FAMILIES = ("algebra", "algorithmic", "arc", "arithmetic", "code", "cognition", "games", "geometry", "graphs",
            "induction", "logic", "probability")
TASKS, G, T, L, E, K = 64, 4, 48, 2, 16, 2


def domain_names(n: int) -> list[str]:
    return [f"rg-{FAMILIES[i % len(FAMILIES)]}_{i:03d}-v0" for i in range(n)]


def record_for(names: list[str]) -> RunRecord:
    return RunRecord(tuple(DomainInfo(d, d, d.split("-")[1].rsplit("_", 1)[0]) for d in names))


def episode(rng: np.random.Generator, d: str, gid: str, p: float) -> Episode:
    n = int(rng.integers(24, T))
    mask = (0,) * 8 + (1,) * (n - 8)
    return Episode(task_id=gid, domain=d, group_id=gid, token_ids=tuple(int(x) for x in rng.integers(10, 90, n)),
                   loss_mask=mask, rollout_logprobs=tuple(-0.5 if m else 0.0 for m in mask), messages=(),
                   reward=float(rng.random() < p), num_turns=int(rng.integers(1, 4)), wall_s=0.1)


def groups_for(rng: np.random.Generator, tasks: list[str], p_of: dict[str, float], step: int) -> list[RolloutGroup]:
    return [RolloutGroup(task_id=t, domain=t.split("#")[0],
                         episodes=tuple(episode(rng, t.split("#")[0], f"{step}-{i}", p_of[t.split("#")[0]]) for _ in range(G)))
            for i, t in enumerate(tasks)]


def driver_overhead(n_domains: int, rule: str, reps: int, run_dir: Path) -> dict[str, float]:
    """Median ms per step, by part, of the per-domain driver work for n_domains (see the module docstring)."""
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    names = domain_names(n_domains)
    rec = record_for(names)
    p_of = {d: float(rng.uniform(0.05, 0.95)) for d in names}
    pools = {d: [f"{d}#{j}" for j in range(32)] for d in names}
    sampler = DomainSampler(pools, {d: 1.0 for d in names}, adaptive=True, rule=rule, families=rec.family_of())
    sink = MetricsSink(run_dir, wandb_mode="disabled")
    times = []
    try:
        for step in range(reps + 2):
            tasks = sampler.sample(TASKS)
            groups = groups_for(rng, tasks, p_of, step)  # the rollout: not part of the overhead
            B = len(groups) * G
            doms = sorted({g.domain for g in groups})
            dom_B = torch.tensor([doms.index(g.domain) for g in groups for _ in g.episodes])
            mask_BT = torch.rand(B, T, generator=gen) < 0.7
            logits_LNE = torch.randn(L, B * T, E, generator=gen)
            routes = logits_LNE.topk(K, dim=-1).indices
            parts: dict[str, float] = {}

            def timed(name, fn):
                t = time.perf_counter()
                out = fn()
                parts[name] = parts.get(name, 0.0) + 1000 * (time.perf_counter() - t)
                return out
            timed("sampler", lambda: sampler.observe(groups))
            _, ds_m = timed("zero-var", lambda: dynamic_sampling(groups, "filter"))
            _, agg_m = timed("normalise", lambda: aggregation_weights("domain_token_mean", mask_BT, domain_ids_B=dom_B,
                                                                    domain_names=dict(enumerate(doms))))
            values = {**ds_m, **agg_m, **timed("rollout_metrics", lambda: rollout_metrics(groups, (4, 5), policy_version=step))}
            values.update(timed("moe", lambda: moe_telemetry(routes, token_domain_ids(dom_B, T), doms, E,
                                                             token_mask_N=mask_BT.reshape(-1), router_logits=logits_LNE)))
            values.update({f"sampler/weight/{d}": w for d, w in sampler.weights.items()})
            timed("log", lambda: sink.log(StepMetrics(step=step, values=values)))
            timed("sample", lambda: sampler.sample(TASKS))
            if step >= 2:  # warm-up
                times.append(parts)
    finally:
        sink.close()
    return {k: statistics.median(p[k] for p in times) for k in times[0]}


def synthetic_run(run_dir: Path, n_domains: int, steps: int = 20, seed: int = 0) -> Path:
    """A run directory with `n_domains` domains in 12 families: the run record, per-domain reward /
    success / zero-variance / weight / MoE load metrics for `steps` steps (reward trends that differ by
    domain, so there are movers), and one sample per step."""
    rng = np.random.default_rng(seed)
    names = domain_names(n_domains)
    rec = record_for(names)
    write_run_record(run_dir, rec)
    start = {d: float(rng.uniform(0.0, 0.8)) for d in names}
    slope = {d: float(rng.normal(0.0, 0.02)) for d in names}
    fam_pref = {f: i % E for i, f in enumerate(FAMILIES)}
    sink = MetricsSink(run_dir, wandb_mode="disabled", config={"name": f"synthetic-{n_domains}"})
    try:
        for s in range(steps):
            v: dict[str, float] = {"loss/total": 0.1 / (1 + s), "time/step_s": 5.4, "reward/mean/all": 0.4}
            for info in rec.domains:
                d = info.name
                r = min(1.0, max(0.0, start[d] + slope[d] * s + float(rng.normal(0, 0.03))))
                v[f"reward/mean/{d}"] = r
                v[f"reward/std/{d}"] = 0.2
                v[f"success/rate/{d}"] = r
                v[f"rollout/zero_var_frac/{d}"] = float(rng.uniform(0, 1))
                v[f"sampler/weight/{d}"] = 1.0 / n_domains
                pref = fam_pref[info.family]
                for e in range(E):
                    v[f"moe/load_e{e:03d}/{d}"] = float(2.5 if e == pref else rng.uniform(0.7, 1.1))
            sink.log(StepMetrics(step=s, values=v, samples=[{"domain": names[s % n_domains], "task_id": f"t{s}",
                                                              "reward": "1.0", "turns": "1", "transcript": "answer 42"}]))
    finally:
        sink.close()
    return run_dir


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--step-s", type=float, default=5.38, help="a measured RL step time (s) the overhead adds to")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    torch.set_num_threads(1)  # the driver's own work; several threads only fight the other jobs on 2 cores
    from rl.observe import report

    with tempfile.TemporaryDirectory() as tmp:
        print(f"driver overhead per step, {TASKS} tasks x {G} samples (median of {reps}, ms; 1 torch thread):")
        names = ("sampler", "zero-var", "normalise", "rollout_metrics", "moe", "log", "sample")
        print(f"  {'domains':>7} {'rule':>12} " + " ".join(f"{n:>15}" for n in names) + f" {'total':>8}  step ratio vs 4")
        base = {}
        for n in (4, 100, 500):
            for r in ("learnability", "dump"):
                parts = driver_overhead(n, r, reps, Path(tmp) / f"o{n}{r}")
                total = sum(parts.values())
                base.setdefault(r, total)
                ratio = (args.step_s * 1000 + total) / (args.step_s * 1000 + base[r])
                print(f"  {n:>7} {r:>12} " + " ".join(f"{parts[k]:>15.1f}" for k in names)
                      + f" {total:>8.1f}  {ratio:.3f}x (step = {args.step_s:.2f} s + overhead; target <= 1.05x)")
        rd = synthetic_run(Path(tmp) / "r500", 500, steps=10 if args.quick else 20)
        t0 = time.perf_counter()
        run = report.load_run(rd)
        t1 = time.perf_counter()
        page = report.render_report(run)
        t2 = time.perf_counter()
        size = len(page.encode())
        print(f"report at 500 domains / {len(run.steps)} steps: load {t1 - t0:.2f} s + render {t2 - t1:.2f} s = "
              f"{t2 - t0:.2f} s (target <= 10 s), {size / 1e6:.2f} MB (target <= 5 MB), "
              f"{len(run.domains)} domains in {len(run.families)} families")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
