"""Write a demonstration file (`trainer.sft_data`, rl/sft.py) from a domain's reference solutions, optionally
with a teacher's mistakes mixed in.

Each line holds one train task's assistant turns. With `--wrong P`, a seeded fraction P of the tasks get a
teacher's mistake instead of the reference. This models a distillation set that was not filtered by a grader,
the setting where imitation is capped by its data and reward can select beyond it (docs/training.md,
"Demonstrations from an unverified teacher"). `--mistake` says which mistake:

* `other-task` (any domain): the reference of *another* train task whose reference differs (the teacher
  answered the wrong question: another command family in terminal-basics, other dimensions or another
  primitive in cad-primitive). In cad-primitive these demonstrations carry numbers the prompt does not
  have, so they are noise that imitation averages away.
* `pose-blind` (cad-primitive-v0 only): the task's own primitive and numbers, built on the XY workplane and
  centred at the origin whatever axis and placement the prompt asks for. A systematic, prompt-conditioned
  error, like terminal's wrong family: imitation learns it as part of the mapping. Tasks whose pose is
  already that one are unaffected (they are not counted as wrong).

    .venv/bin/python scripts/make_demonstrations.py terminal-basics-v0 runs/demos/terminal.jsonl --tasks 48 --wrong 0.5
    .venv/bin/python scripts/make_demonstrations.py cad-primitive-v0 runs/demos/cad_pose.jsonl --tasks 48 --wrong 0.7 --mistake pose-blind

The task ids are those of `envs.tasks(ENV_ID, "train", seed=--env-seed)`: use the run's `envs.seed`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


MISTAKES = ("other-task", "pose-blind")


def _pose_blind(task, calls: list) -> list:
    """cad-primitive: the same primitive and numbers on the default pose (workplane XY, centred)."""
    from envs.base import ToolInvocation
    from envs.cad.primitive import CENTRED_Z, PRIMITIVES

    code = PRIMITIVES[task.private["family"]].reference(task.private["params"], CENTRED_Z)
    return [ToolInvocation(c.name, {**c.arguments, "code": code}) if c.name == "submit" else c for c in calls]


def demonstrations(env_id: str, n_tasks: int, wrong: float, seed: int = 0, env_seed: int = 0,
                   mistake: str = "other-task") -> tuple[list[dict], int]:
    """(lines, how many are wrong) for the first `n_tasks` train tasks of `env_id`."""
    import envs
    from envs.base import messages_for_calls
    from jointrl.records import Task

    if not 0.0 <= wrong <= 1.0:
        raise ValueError(f"--wrong: {wrong} is not a fraction in [0, 1]")
    if mistake not in MISTAKES:
        raise ValueError(f"--mistake: {mistake!r} is not one of {', '.join(MISTAKES)}")
    if mistake == "pose-blind" and env_id != "cad-primitive-v0":
        raise ValueError(f"--mistake pose-blind: only cad-primitive-v0 has poses, not {env_id}")
    tasks = [Task.from_row(r) for r in envs.tasks(env_id, "train", seed=env_seed)]
    env = envs.make(env_id)
    try:
        refs = [env.reference(t) for t in tasks]
    finally:
        env.close()
    rng = random.Random(seed)
    lines: list[dict] = []
    n_wrong = 0
    for i, task in enumerate(tasks[:n_tasks]):
        calls = refs[i]
        if rng.random() < wrong:
            if mistake == "pose-blind":
                calls = _pose_blind(task, calls)
                n_wrong += calls != refs[i]
            else:
                others = [j for j in range(len(tasks)) if refs[j] != refs[i]]
                if others:
                    calls = refs[rng.choice(others)]
                    n_wrong += 1
        lines.append({"task_id": task.id, "messages": [m.to_openai() for m in messages_for_calls(calls)]})
    return lines, n_wrong


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("env_id")
    ap.add_argument("out", type=Path)
    ap.add_argument("--tasks", type=int, default=48, help="the first N train tasks")
    ap.add_argument("--wrong", type=float, default=0.0, help="fraction of tasks given another task's reference")
    ap.add_argument("--mistake", choices=MISTAKES, default="other-task", help="which mistake a wrong demonstration makes")
    ap.add_argument("--seed", type=int, default=0, help="which tasks get a wrong demonstration")
    ap.add_argument("--env-seed", type=int, default=0, help="the task set's seed: the run's envs.seed")
    args = ap.parse_args(argv)
    lines, n_wrong = demonstrations(args.env_id, args.tasks, args.wrong, args.seed, args.env_seed, args.mistake)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    print(f"{args.out}: {len(lines)} demonstrations of {args.env_id}, {n_wrong} of them wrong ({args.mistake})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
