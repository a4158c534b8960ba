#!/usr/bin/env python
"""Submit a jointrl training run to a Ray cluster with `ray job submit`.

    python scripts/ray_submit.py --address http://HEAD:8265 configs/quickstart.yaml trainer.steps=100

The job's runtime env ships this working tree (`working_dir`, which is the job's cwd, so the
project's packages import from it), installs the pinned dependencies plus the GPU extra on the
cluster (`pip`, read from pyproject.toml), and points the caches at node-local scratch. Inside the job the
driver sees RAY_ADDRESS and joins the cluster instead of starting Ray in-process; resources per
role come from the config (`rollout.num_workers`, `trainer.num_workers`). The config is validated
here first, so a typo fails before anything is submitted.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pinned_requirements(extra: str) -> list[str]:
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(proj["dependencies"]) + list(proj["optional-dependencies"][extra])


def build_command(args: argparse.Namespace) -> list[str]:
    from rl.config import load_config

    load_config(args.config, args.overrides)  # fail here, not on the cluster
    runtime_env = {
        "working_dir": str(ROOT),
        "excludes": [".venv", ".cache", "runs", ".git"],
        # The uploaded working dir is the job's cwd, so rl/ envs/ model/ rewards/ import from it;
        # the cluster only needs the pinned dependencies (and the vLLM build for its hardware).
        "pip": pinned_requirements(args.extra),
        "env_vars": {"JOINTRL_CACHE": args.cache_dir, "JOINTRL_PROGRESS": "0", "WANDB_MODE": args.wandb_mode},
    }
    entry = ["python", "-m", "rl.cli", "train", args.config, *args.overrides]
    return ["ray", "job", "submit", "--address", args.address, "--runtime-env-json", json.dumps(runtime_env),
            *(["--no-wait"] if args.no_wait else []), "--", *entry]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://head:8265")
    p.add_argument("--extra", default="gpu", choices=["gpu", "cpu"], help="which vLLM build the cluster installs")
    p.add_argument("--cache-dir", default="/tmp/jointrl-cache")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--print-only", action="store_true", help="print the ray job submit command, submit nothing")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cmd = build_command(args)
    if args.print_only:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
