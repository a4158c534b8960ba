"""`jointrl envs ...`: list, check, play, tasks. The top-level CLI (rl/cli.py) calls `main(argv)`.

    jointrl envs list                         registered ids (and domains skipped, with the reason)
    jointrl envs check terminal-v0 [--n 4]    the conformance checker (exit 1 on failure)
    jointrl envs play terminal-v0 [--policy reference|noop] [--split train] [--seed 0] [--index 0]
    jointrl envs tasks terminal-v0 [--split train] [--seed 0] [--n N]   build/cache a task set
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jointrl envs", description="Environments: list, check, play, build task sets.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list registered environment ids")
    c = sub.add_parser("check", help="run the conformance checker")
    c.add_argument("env_id")
    c.add_argument("--n", type=int, default=4, help="tasks to run episodes on (default 4)")
    c.add_argument("--seed", type=int, default=0)
    pl = sub.add_parser("play", help="run one episode with a scripted policy and print the transcript")
    pl.add_argument("env_id")
    pl.add_argument("--policy", choices=("reference", "noop"), default="reference")
    pl.add_argument("--split", default="train")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--index", type=int, default=0, help="which task of the split")
    t = sub.add_parser("tasks", help="generate (and cache) a task set; print its size and first id")
    t.add_argument("env_id")
    t.add_argument("--split", default="train")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--n", type=int, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from envs import registry

    if args.cmd == "list":
        for s in registry.list_envs():
            print(f"{s.env_id:24s} {s.description}")
        for name, why in registry.discovery_errors().items():
            print(f"(skipped) {name}: {why}")
        return 0
    try:
        registry.spec(args.env_id)
    except KeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        from envs.check import check_env

        report = check_env(args.env_id, n_tasks=args.n, seed=args.seed)
        print(report.render())
        return 0 if report.passed else 1
    if args.cmd == "play":
        from envs.play import play_env

        tr = play_env(args.env_id, args.policy, split=args.split, seed=args.seed, index=args.index)
        print(tr.render())
        return 0
    ds = registry.tasks(args.env_id, args.split, seed=args.seed, n=args.n)
    print(f"{args.env_id} {args.split} seed={args.seed}: {len(ds)} tasks" + (f"; first: {ds[0]['id']}" if len(ds) else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
