"""The `jointrl` command line: train, eval, serve, envs, export, models, jobs, report.

Each subcommand parses its own arguments here and then calls one function in the module that owns
the feature (imported lazily, so `jointrl --help` is fast).
Config errors exit 2 with the message naming the key, before anything starts.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

EXIT_CONFIG = 2


def _call(module: str, func: str, *args) -> int:
    """`module.func(*args)`, the module imported only now; its return value as the exit code."""
    return int(getattr(importlib.import_module(module), func)(*args) or 0)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML run config (e.g. configs/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5 envs.weights.swe=0.5")


def _choice(args: argparse.Namespace) -> str:
    return "resume" if args.resume else "new" if args.new_run else "auto"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jointrl", description="Joint multi-domain RL post-training for sparse MoE LLMs.")
    sub = parser.add_subparsers(dest="cmd", metavar="{train,eval,serve,tinker,envs,export,models,jobs,report}")

    p = sub.add_parser("train", help="run SFT warm-start + RL from a YAML config (Ray started in-process unless RAY_ADDRESS is set)",
                       description="Train from CONFIG (required; '-' for the built-in defaults). A run directory that already "
                                   "holds a run is resumed when its config matches; otherwise the run is refused, naming the "
                                   "keys that differ, unless --resume or --new-run says what to do.")
    p.add_argument("config", metavar="CONFIG", nargs="?", default=None,
                   help="YAML run config (e.g. configs/quickstart.yaml), or '-' for the built-in defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5 envs.weights.swe=0.5")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, names, files, resources and the run directory without side effects (no "
                        "downloads, no Ray); print the resolved config, the placement and what a real run would pull")
    choose = p.add_mutually_exclusive_group()
    choose.add_argument("--resume", action="store_true",
                        help="continue the run in the run directory even though its config differs (the change is recorded)")
    choose.add_argument("--new-run", action="store_true",
                        help="move an existing run directory aside (RUN_DIR.prev-<time>) and start a new run there")

    p = sub.add_parser("eval", help="evaluate a checkpoint on each domain's held-out split")
    p.add_argument("checkpoint", help="checkpoint directory (HF format, or a run's), a pullable model name "
                   "(`jointrl models list`, pulled on first use), a URL of exported weights, or a shipped model config name")
    p.add_argument("--config", default=None, help="YAML run config for env/rollout settings")
    p.add_argument("--tasks-per-domain", type=int, default=8, help="held-out tasks evaluated per domain (default 8)")
    from rl.rollout.tiers import TIERS  # light: the names of jointrl.records.ThinkingTier

    p.add_argument("--tiers", default=None, help=f"comma-separated thinking tiers to evaluate ({','.join(TIERS)})")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the run config, e.g. eval.samples=2")

    p = sub.add_parser("serve", help="OpenAI chat-completions and Anthropic Messages endpoints over a vLLM engine")
    from rl.serve.settings import add_arguments as add_serve_arguments  # light: the flags are generated from ServeSettings

    add_serve_arguments(p)

    p = sub.add_parser("envs", help="environment registry: list | check ID | play ID", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the envs subcommand and its arguments (`jointrl envs --help`)")

    p = sub.add_parser("export", help="export a checkpoint (e.g. with MXFP4 expert weights)")
    p.add_argument("--mxfp4", action="store_true", help="quantize weights to MXFP4 (OCP MX v1.0)")
    p.add_argument("--include", choices=["experts", "all_linear"], default="experts",
                   help="which weights --mxfp4 quantizes: the MoE experts (default) or every linear layer")
    p.add_argument("--rest-dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="dtype of the tensors kept in high precision (default: as in the source)")
    p.add_argument("src", help="run dir or checkpoint dir")
    p.add_argument("out", nargs="?", default=None, help="output directory (or --to URL)")
    p.add_argument("--to", default=None, help="file:// / s3:// / gs:// URL: sharded safetensors + manifest (rl/weights/objstore.py)")
    p.add_argument("--shards", type=int, default=8, help="with --to and without --mxfp4: number of safetensors shards")

    p = sub.add_parser("tinker", help="a Tinker-compatible training service: serve MODEL (docs/tinker.md)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the tinker subcommand and its arguments (`jointrl tinker --help`)")

    p = sub.add_parser("jobs", help="agent jobs: serve MODEL | submit | status | watch | cancel", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the jobs subcommand and its arguments (`jointrl jobs --help`)")

    p = sub.add_parser("models", help="pretrained models: pull NAME (prints its checkpoint dir last) | list")
    importlib.import_module("rl.models_cli").add_arguments(p)

    p = sub.add_parser("report", help="write a self-contained HTML report for a run directory")
    p.add_argument("run_dir", help="a run directory (runs/<name>), finished or still running")
    p.add_argument("--out", default=None, help="output HTML path (default RUN_DIR/report.html)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["envs"]:  # the envs module owns its sub-subcommands and their --help
        return _call("envs.cli", "main", argv[1:])
    if argv[:1] == ["tinker"]:  # the Tinker service owns its sub-subcommands and their --help
        return _call("rl.tinker.app", "main", argv[1:])
    if argv[:1] == ["jobs"]:  # the jobs module owns its sub-subcommands and their --help
        return _call("rl.jobs.cli", "main", argv[1:])
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return EXIT_CONFIG

    from rl.config import ConfigError, load_config

    if args.cmd == "train" and (args.config is None or "=" in args.config):
        # Nothing asked for: say how to ask, start nothing (a default run is `jointrl train -`).
        parser._subparsers._group_actions[0].choices["train"].print_usage(sys.stderr)  # noqa: SLF001
        print("jointrl train: give a YAML run config (e.g. configs/quickstart.yaml), or '-' for the built-in defaults; "
              "`jointrl train --help` for more", file=sys.stderr)
        return EXIT_CONFIG

    try:
        if args.cmd == "train":
            path = None if args.config == "-" else args.config
            if args.dry_run:
                from rl.dryrun import dry_run

                return dry_run(path, args.overrides, choice=_choice(args))
            from rl.config import pull_models, to_dict

            # start-up: pull a pullable model.arch / model.reference (and check its weights) before the run directory
            # is decided, so config.json records the directory a resume compares against
            cfg = pull_models(load_config(path, args.overrides))
            from rl.rundir import apply, decide

            decision = decide(to_dict(cfg), cfg.resolved_run_dir(), _choice(args), resume_enabled=cfg.trainer.resume)
            if decision.action == "refuse":
                print(f"jointrl train: {decision.message}", file=sys.stderr)
                return EXIT_CONFIG
            print(f"jointrl train: {decision.message}", file=sys.stderr, flush=True)
            apply(decision, to_dict(cfg))
            return _call("rl.run", "main", cfg)
        if args.cmd == "eval":
            cfg = load_config(args.config, args.overrides)
            tiers = tuple(args.tiers.split(",")) if args.tiers else None
            return _call("rl.evaluate", "main", cfg, args.checkpoint, args.tasks_per_domain, tiers)
        if args.cmd == "serve":
            return _call("rl.serve.app", "main_from_args", args)
        if args.cmd == "export" and args.to is not None:
            return _call("rl.weights.objstore", "main_export_cli", args)
        if args.cmd == "export":
            if args.out is None:
                print("jointrl export: give an output directory or --to URL", file=sys.stderr)
                return EXIT_CONFIG
            if not args.mxfp4:
                print("jointrl export: only --mxfp4 export exists; pass --mxfp4", file=sys.stderr)
                return EXIT_CONFIG
            return _call("model.mxfp4_export", "main_export", args.src, args.out, args.include, args.rest_dtype)
        if args.cmd == "models":
            return _call("rl.models_cli", "main", args)
        if args.cmd == "report":
            return _call("rl.observe.report", "main", args.run_dir, args.out)
    except ConfigError as e:
        print(f"jointrl: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:
        from rl.admission import AdmissionRefused

        if not isinstance(e, AdmissionRefused):
            raise
        print(f"jointrl {args.cmd}: refused: {e}", file=sys.stderr)
        return EXIT_CONFIG
    parser.error(f"unknown command {args.cmd}")
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
