#!/usr/bin/env python
"""Submit a jointrl training run to a Ray cluster with `ray job submit`.

    python scripts/ray_submit.py --address http://HEAD:8265 configs/quickstart.yaml trainer.steps=100

The job's runtime env ships this working tree (`working_dir`, which is the job's cwd, so the
project's packages import from it), installs the pinned dependencies plus the GPU extra on the
cluster (`pip`, read from pyproject.toml; `--no-pip` when the nodes' Python already has them, e.g.
nodes started from this project's `.venv`, then `--python` names that interpreter), and points the
caches at node-local scratch. Inside the job the driver sees RAY_ADDRESS and joins the cluster
instead of starting Ray in-process; resources per role come from the config (`rollout.num_workers`,
`trainer.num_workers`, `*.node_resource`). The config is validated here first, so a typo fails
before anything is submitted.

Where things end up: the uploaded working dir is a temporary copy, so a relative `run_dir` is
placed under `--run-root` on the node that runs the job's driver (the head node unless the cluster
says otherwise); the launcher names that directory and the job's submission id before submitting.
Without `--no-wait` it streams the job's logs until the job ends and exits 1 if the job failed
(`ray job submit`'s own behaviour). It does not copy the run directory off the cluster.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Submission:
    """What the launcher submits and where the job will write."""

    command: list[str]  # the `ray job submit ...` argv
    submission_id: str
    run_dir: str  # absolute, on the node running the job's driver


def pinned_requirements(extra: str) -> list[str]:
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(proj["dependencies"]) + list(proj["optional-dependencies"][extra])


def build_submission(args: argparse.Namespace) -> Submission:
    from rl.config import load_config

    cfg = load_config(args.config, args.overrides)  # fail here, not on the cluster
    overrides = list(args.overrides)
    run_dir = cfg.run_dir.replace("${name}", cfg.name)
    if not Path(run_dir).is_absolute():
        # In the job, relative paths resolve inside the uploaded copy of the tree, which Ray may delete.
        run_dir = str(Path(args.run_root) / run_dir)
        overrides.append(f"run_dir={run_dir}")
    submission_id = args.submission_id or f"jointrl-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    runtime_env: dict = {
        "working_dir": str(ROOT),
        "excludes": [".venv", ".cache", "runs", ".git"],
        "env_vars": {"JOINTRL_CACHE": args.cache_dir, "JOINTRL_PROGRESS": "0", "WANDB_MODE": args.wandb_mode},
    }
    if not args.no_pip:
        # The uploaded working dir is the job's cwd, so rl/ envs/ model/ rewards/ import from it;
        # the cluster only needs the pinned dependencies (and the vLLM build for its hardware).
        runtime_env["pip"] = pinned_requirements(args.extra)
    entry = [args.python, "-m", "rl.cli", "train", args.config, *overrides]
    command = ["ray", "job", "submit", "--address", args.address, "--runtime-env-json", json.dumps(runtime_env),
               "--submission-id", submission_id, *(["--no-wait"] if args.no_wait else []), "--", *entry]
    return Submission(command=command, submission_id=submission_id, run_dir=run_dir)


def build_command(args: argparse.Namespace) -> list[str]:
    return build_submission(args).command


def _ray_executable() -> str:
    """`ray` from this interpreter's environment (the client then matches the installed Ray), else from PATH."""
    here = Path(sys.executable).with_name("ray")
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def _say(text: str) -> None:
    print(f"ray_submit: {text}", file=sys.stderr, flush=True)  # stdout carries the command or the job's logs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://head:8265")
    p.add_argument("--extra", default="gpu", choices=["gpu", "cpu"], help="which vLLM build the cluster installs")
    p.add_argument("--no-pip", action="store_true",
                   help="install nothing: the cluster's Python already has the pinned dependencies")
    p.add_argument("--python", default="python", help="interpreter that runs the job's driver on the cluster")
    p.add_argument("--cache-dir", default="/tmp/jointrl-cache")
    p.add_argument("--run-root", default="/tmp/jointrl",
                   help="where a relative run_dir goes on the node running the job's driver")
    p.add_argument("--submission-id", default=None, help="default: jointrl-NAME-TIMESTAMP")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--print-only", action="store_true", help="print the ray job submit command, submit nothing")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if not Path(args.run_root).is_absolute():
        p.error(f"--run-root {args.run_root!r} must be an absolute path (it is a path on the cluster)")
    sub = build_submission(args)
    _say(f"job {sub.submission_id}: run directory {sub.run_dir} (on the node running the job's driver)")
    if args.print_only:
        print(shlex.join(sub.command))
        return 0
    rc = subprocess.call([_ray_executable(), *sub.command[1:]])
    logs = f"{_ray_executable()} job logs --address {args.address} {sub.submission_id}"
    if args.no_wait:
        _say(f"submitted job {sub.submission_id}; follow it with `{logs} --follow`")
    else:
        _say(f"job {sub.submission_id} {'succeeded' if rc == 0 else f'failed (exit {rc})'}; "
             f"its logs: `{logs}`; its run directory: {sub.run_dir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
