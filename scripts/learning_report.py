"""Figures of a finished learning run, from its run directory: the per-step time breakdown of RL on the
real policy (generate / tools / grade / train / sync / idle, mean of the measured steps), the three
held-out arms side by side (after SFT, after SFT + RL, after SFT continued for RL's wall time) with
95% CIs and paired t, and held-out points gained per 10 minutes of RL.

    .venv/bin/python scripts/learning_report.py runs/learning_smollm2 [--skip-steps 1] [--against runs/OTHER]

`--against OTHER` also compares this run with another run of the same held-out evaluation (a knob
changed, or the same recipe repeated): for each arm both runs have, success here minus success there,
paired by task (the evaluation's per-request seeds depend on the task, not the run, so both runs
sampled the same way), with its 95% CI and paired t. Within one run the arms share one RL trajectory;
only a second run shows the spread between runs of the same recipe.

Reads RUN_DIR/metrics.jsonl (the `time/*` keys, rl/observe/telemetry.py) and RUN_DIR/eval.json (rl/evaluate.py);
RL's wall time is eval.json's `rl_seconds`, else the sum of `time/step_s`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PARTS = ("rollout_generate_s", "rollout_tools_s", "rollout_grade_s", "train_s", "sync_s", "trainer_idle_s", "rollout_idle_s")


def step_breakdown(rows: list[dict], skip: int) -> dict[str, float]:
    """Mean of each `time/<part>` over the steps after the first `skip` (the first step pays warm-ups)."""
    steps = [r for r in rows if "time/step_s" in r][skip:]
    if not steps:
        return {}
    return {p: statistics.fmean(r.get(f"time/{p}", 0.0) for r in steps) for p in ("step_s", *PARTS)} | {"steps": float(len(steps))}


def rl_seconds(doc: dict, rows: list[dict]) -> float:
    return float(doc.get("rl_seconds") or sum(r.get("time/step_s", 0.0) for r in rows))


def format_report(doc: dict, rows: list[dict], skip: int) -> str:
    out = []
    b = step_breakdown(rows, skip)
    if b:
        out.append(f"RL step time, mean of {int(b['steps'])} steps (first {skip} skipped), seconds:")
        out.append(f"  step {b['step_s']:.1f} = generate {b['rollout_generate_s']:.1f} + tools {b['rollout_tools_s']:.1f} + "
                   f"grade {b['rollout_grade_s']:.1f} + train {b['train_s']:.1f} + sync {b['sync_s']:.2f} (+ waits); "
                   f"trainer idle {b['trainer_idle_s']:.1f}, rollout idle {b['rollout_idle_s']:.1f}")
    secs = rl_seconds(doc, rows)
    out.append(f"RL wall time: {secs / 60:.1f} min")
    head = f"{'environment':<22} {'n':>4} {'after SFT':>17} {'SFT + RL':>17} {'SFT control':>17} {'gain':>7} {'t':>6} {'RL-ctl':>7} {'t':>6} {'pts/10min':>9}"
    out += [head, "-" * len(head)]

    def cell(p, ci):
        lo, hi = (x if x is not None else float("nan") for x in ci)
        return f"{p:.3f} [{lo:.2f},{hi:.2f}]"

    for env, e in doc.get("domains", {}).items():
        ctl = cell(e["success_sft_control"], e["ci95_sft_control"]) if "success_sft_control" in e else "-"
        t = e["paired_t"] if e["paired_t"] is not None else float("nan")
        rc = e.get("gain_rl_vs_sft_control")
        rct = e.get("paired_t_rl_vs_sft_control")
        per10 = 100.0 * e["gain"] / (secs / 600.0) if secs else float("nan")
        out.append(f"{env:<22} {e['n']:>4} {cell(e['success_before'], e['ci95_before']):>17} {cell(e['success_after'], e['ci95_after']):>17} "
                   f"{ctl:>17} {e['gain']:>+7.3f} {t:>6.2f} {(rc if rc is not None else float('nan')):>+7.3f} "
                   f"{(rct if rct is not None else float('nan')):>6.2f} {per10:>9.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--skip-steps", type=int, default=1)
    ap.add_argument("--against", metavar="OTHER_RUN_DIR", help="compare each arm with the same arm of another run")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "metrics.jsonl").exists() else []
    if (run / "eval.json").is_file():
        doc = json.loads((run / "eval.json").read_text())
    elif (run / "eval_before.json").is_file() and (run / "eval_after.json").is_file():
        doc = partial_doc(run, rows)
        print("(eval.json absent: the run stopped after the after-RL evaluation; arms from eval_before.json, "
              "eval_after.json" + (", eval_sft_control.json" if (run / "eval_sft_control.json").is_file() else "") + ")")
    else:
        print(f"learning_report: {run}/eval.json not found, nor eval_before.json and eval_after.json (the run has not "
              "reached its after-RL evaluation)", file=sys.stderr)
        return 2
    print(format_report(doc, rows, args.skip_steps))
    if args.against:
        try:
            print(format_against(run, Path(args.against)))
        except ValueError as e:
            print(f"learning_report: --against: {e}", file=sys.stderr)
            return 2
    return 0


ARMS = ("before", "after", "sft_control")


def arm_tasks(run: Path, arm: str) -> dict[tuple[str, str], tuple[float, ...]]:
    """Per (domain, tier): the per-task success of one arm (RUN/eval_<arm>.json); {} when the arm is absent."""
    f = run / f"eval_{arm}.json"
    if not f.is_file():
        return {}
    return {(r["domain"], r["tier"]): tuple(r["task_success"]) for r in json.loads(f.read_text())}


def format_against(run: Path, other: Path) -> str:
    """Each arm of `run` minus the same arm of `other`, paired by held-out task."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rl.evaluate import paired_diff

    head = f"{'arm':<12} {'domain':<18} {'tier':<5} {'n':>4} {'this':>6} {'other':>6} {'diff':>7} {'95% CI':>17} {'t':>6}"
    out = [f"against {other}:", head, "-" * len(head)]
    for arm in ARMS:
        mine, theirs = arm_tasks(run, arm), arm_tasks(other, arm)
        for key in sorted(mine.keys() & theirs.keys()):
            a, b = mine[key], theirs[key]
            if len(a) != len(b):
                raise ValueError(f"arm {arm!r}, domain {key[0]!r}: {len(a)} held-out tasks here, {len(b)} in {other}; "
                                 "a paired comparison needs the same tasks")
            p = paired_diff(b, a)
            out.append(f"{arm:<12} {key[0]:<18} {key[1]:<5} {p.n:>4} {sum(a) / len(a):>6.3f} {sum(b) / len(b):>6.3f} "
                       f"{p.mean:>+7.3f} [{p.ci_low:>+6.3f},{p.ci_high:>+6.3f}] {p.t:>6.2f}")
    if len(out) == 3:
        raise ValueError(f"no arm of {run} and {other} shares a domain and tier (eval_<arm>.json files)")
    return "\n".join(out)


def partial_doc(run: Path, rows: list[dict]) -> dict:
    """eval.json's document rebuilt from the per-arm files of a run stopped before its end (e.g. during the
    SFT control arm) by `rl.evaluate.eval_doc`, as the run would have written it, RL's wall time summed from
    the step metrics."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rl.evaluate import EvalRow, eval_doc

    def arm(name: str) -> list[EvalRow] | None:
        f = run / f"eval_{name}.json"
        if not f.is_file():
            return None
        return [EvalRow(**{**r, "task_success": tuple(r["task_success"])}) for r in json.loads(f.read_text())]

    env_ids = json.loads((run / "config.json").read_text())["envs"]["env_ids"] if (run / "config.json").is_file() else {}
    return eval_doc(env_ids, arm("before"), arm("after"), arm("sft_control"), rl_seconds(dict(), rows) or None)


if __name__ == "__main__":
    raise SystemExit(main())
