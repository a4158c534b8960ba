"""The learning runs of docs/training.md ("Learning on the real policy"), one command each: the demonstration
file a recipe needs (scripts/make_demonstrations.py), the three-arm run (`jointrl train`: after SFT, after
SFT + RL, SFT continued for RL's wall time) and its figures (scripts/learning_report.py).

    bash scripts/setup.sh                                   # once
    .venv/bin/python scripts/learning_run.py terminal-teacher      # attempt 12 (50 min); repeated as attempt 17 (21 min):
                                                                   #   add name=learning_terminal_teacher8_r2
    .venv/bin/python scripts/learning_run.py terminal-teacher name=learning_terminal_teacher8_kl \
        algorithm.kl_coef=0.04 eval.sft_control=false              # a knob against attempt 17 (docs/training.md);
    .venv/bin/python scripts/learning_report.py runs/learning_terminal_teacher8_kl --against runs/learning_terminal_teacher8_r2
        # the other knobs of docs/training.md the same way: rollout.temperature=0.7, trainer.frozen_layers=0,
        # trainer.lora.rank=16 "trainer.lora.targets=[attention,experts]" trainer.frozen_layers=0 trainer.lr=1e-3
        # trainer.sft_lr=1e-3, envs.default_tier.terminal_basics=high, algorithm.group_size=4 trainer.tasks_per_step=12
    .venv/bin/python scripts/learning_run.py cad-pose              # attempt 14: ~65 min
    .venv/bin/python scripts/learning_run.py cad-pose trainer.steps=12     # attempt 15 (run as 14 resumed to step 12)
    .venv/bin/python scripts/learning_run.py cad-pose name=learning_cad_pose240 eval.n_per_domain=240   # attempt 16: ~98 min
    .venv/bin/python scripts/learning_run.py terminal-teacher --dry-run   # print the commands only
    .venv/bin/python scripts/learning_run.py longhorizon-window    # long episodes (docs/rollout.md): window context,
    .venv/bin/python scripts/learning_run.py longhorizon-full      #   and the same run keeping the full history
    .venv/bin/python scripts/learning_report.py runs/learning_longhorizon_window --against runs/learning_longhorizon_full

Extra `key=value` arguments go to `jointrl train` after the recipe's own (the last one wins). It does not
tune anything: each recipe is the committed config plus the overrides its attempt ran with.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Recipe:
    """One documented learning run: where its demonstrations come from and how it trains."""

    env_id: str
    demos: tuple[str, ...]  # make_demonstrations.py flags after ENV_ID OUT; () = the verified references
    config: str
    overrides: tuple[str, ...]
    attempt: str


RECIPES: dict[str, Recipe] = {
    "terminal": Recipe("terminal-basics-v0", (), "configs/learning_terminal.yaml", (), "8"),
    "cad": Recipe("cad-primitive-v0", (), "configs/learning_cad.yaml", (), "10"),
    "terminal-teacher": Recipe(
        "terminal-basics-v0", ("--tasks", "48", "--wrong", "0.5"), "configs/learning_terminal.yaml",
        ("name=learning_terminal_teacher8", "trainer.sft_steps=12", "trainer.steps=8"), "12"),
    "cad-teacher": Recipe(
        "cad-primitive-v0", ("--tasks", "48", "--wrong", "0.5"), "configs/learning_cad.yaml",
        ("name=learning_cad_teacher2", "trainer.sft_steps=16", "trainer.steps=6"), "13"),
    "cad-pose": Recipe(
        "cad-primitive-v0", ("--tasks", "48", "--wrong", "0.7", "--mistake", "pose-blind"), "configs/learning_cad.yaml",
        ("name=learning_cad_pose", "trainer.sft_steps=48", "trainer.steps=6"), "14"),
    # Long episodes (docs/rollout.md, "Long episodes"): the same run with a window context and with the full history.
    "longhorizon-window": Recipe("terminal-longhorizon-v0", (), "configs/learning_longhorizon.yaml", (), "long-horizon window"),
    "longhorizon-full": Recipe("terminal-longhorizon-v0", (), "configs/learning_longhorizon.yaml",
                               ("name=learning_longhorizon_full", "rollout.context=full"), "long-horizon full"),
}


def commands(name: str, extra: list[str], python: str, jointrl: str) -> list[list[str]]:
    """The recipe's commands in order: [make the demonstrations,] train, report."""
    if name not in RECIPES:
        raise SystemExit(f"learning_run: unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    r = RECIPES[name]
    cmds: list[list[str]] = []
    overrides = list(r.overrides)
    if r.demos:
        out = f"runs/demos/{name}.jsonl"
        cmds.append([python, "scripts/make_demonstrations.py", r.env_id, out, *r.demos])
        overrides += ["trainer.sft_tasks_per_domain=0", f"trainer.sft_data={out}"]
    overrides += extra
    run_name = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("name=")), None)
    if run_name is None:  # the config's own name
        import yaml

        run_name = yaml.safe_load((REPO / r.config).read_text())["name"]
    cmds.append([jointrl, "train", r.config, *overrides])
    cmds.append([python, "scripts/learning_report.py", f"runs/{run_name}"])
    return cmds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", choices=sorted(RECIPES))
    ap.add_argument("overrides", nargs="*", help="key=value overrides for jointrl train")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    venv = REPO / ".venv" / "bin"
    cmds = commands(args.recipe, args.overrides, str(venv / "python"), str(venv / "jointrl"))
    r = RECIPES[args.recipe]
    where = "docs/rollout.md" if r.env_id == "terminal-longhorizon-v0" else "docs/training.md"
    print(f"# {args.recipe}: attempt {r.attempt} in {where}", flush=True)
    for cmd in cmds:
        print("+", shlex.join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, cwd=REPO, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
