"""`jointrl jobs serve|submit|status|watch|cancel`: the jobs service and a client that mirrors its HTTP API.

`serve MODEL --port P --workers N` runs rl/jobs/server.py; the client subcommands talk to
`--url` (default http://127.0.0.1:8100) and print JSON: `submit` the new id, `status` the job,
`watch` one event per line until the job is final (exit 0 when done, 1 when failed or cancelled),
`cancel` the outcome. Config errors exit 2 before anything starts.

Keys: `serve --api-key K` (repeatable: one key per client) or `$JOINTRL_JOBS_API_KEY` (comma-separated);
required with a non-loopback `--host`. The client subcommands send `--api-key K` or
`$JOINTRL_JOBS_API_KEY` as `Authorization: Bearer K`; a job is visible to the key that submitted it only.
`serve --rate-limit-per-s R --rate-limit-burst N` paces each client address (rl/jobs/guard.py: RateGate).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

from rl.config import ConfigError
from rl.jobs.guard import JOBS_KEY_ENV, check_key, keys_from
from rl.jobs.records import SPLITS, TIERS, JobsConfig

DEFAULT_URL = "http://127.0.0.1:8100"
_D = JobsConfig()


def _as_number(kind: type) -> Callable[[str], object]:
    """An argparse type: the flag's text as `kind` when it parses, else the text itself, so that JobsConfig refuses
    it with the one message naming the flag and its allowed values (argparse's own would not name them)."""
    def parse(text: str) -> object:
        try:
            return kind(text)
        except ValueError:
            return text
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jointrl jobs", description="queue-decoupled agent jobs (docs/jobs.md)")
    sub = p.add_subparsers(dest="cmd", metavar="{serve,submit,status,watch,cancel}")

    s = sub.add_parser("serve", help="start the jobs API, the broker and database if none run, the policy and N agent workers")
    s.add_argument("model", help="checkpoint dir, a file:// / s3:// URL of an exported one, a pullable model (`jointrl models list`), or a shipped config name (tiny: random weights)")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs an API key")
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"accept this key (repeat for several clients; each sees only its own jobs); default ${JOBS_KEY_ENV}, comma-separated")
    s.add_argument("--workers", type=int, default=_D.workers, help="replicas at start")
    s.add_argument("--min-workers", type=int, default=None, help="autoscaler floor (default: --workers)")
    s.add_argument("--max-workers", type=int, default=None, help="autoscaler ceiling (default: --workers)")
    s.add_argument("--jobs-per-worker", type=float, default=_D.jobs_per_worker, help="autoscaler target of (queued + in flight) per replica")
    s.add_argument("--scale-down-delay", type=float, default=_D.scale_down_delay_s, help="seconds below target before draining a replica")
    s.add_argument("--redis-url", default=_D.redis_url)
    s.add_argument("--db", default=_D.db_url, help="sqlite:///PATH")
    s.add_argument("--policy-url", default=None, help="use this running policy server (python -m rl.jobs.policy) instead of starting one")
    s.add_argument("--claim-timeout", type=float, default=_D.claim_timeout_s, help="seconds before a silent worker's job is claimed by another")
    s.add_argument("--max-attempts", type=int, default=_D.max_attempts, help="attempts before a job goes to the dead-letter stream")
    s.add_argument("--max-turns", type=int, default=None, help="cap on turns per episode (default: the task's own limit)")
    s.add_argument("--max-new-tokens", type=int, default=_D.max_new_tokens_per_turn, help="tokens generated per turn at most")
    s.add_argument("--job-timeout", type=float, default=_D.job_timeout_s,
                   help="seconds one attempt may run; past it the job fails for good and its worker is freed")
    s.add_argument("--rate-limit-per-s", type=_as_number(float), default=_D.rate_limit_per_s, metavar="R",
                   help="requests per second one client address may sustain; past it 429 with Retry-After, before the key "
                        f"check and the body (0: no limit; default {_D.rate_limit_per_s:g})")
    s.add_argument("--rate-limit-burst", type=_as_number(int), default=_D.rate_limit_burst, metavar="N",
                   help=f"requests one client address may send at once before --rate-limit-per-s applies (default {_D.rate_limit_burst})")

    for name, hlp in (("submit", "submit a job"), ("status", "print a job's status and result"),
                      ("watch", "stream a job's events until it ends"), ("cancel", "cancel a job")):
        c = sub.add_parser(name, help=hlp)
        c.add_argument("--url", default=DEFAULT_URL)
        c.add_argument("--api-key", default=None, metavar="KEY", help=f"the key to send (default ${JOBS_KEY_ENV})")
        if name == "submit":
            c.add_argument("env", help="environment id, e.g. terminal-basics-v0")
            c.add_argument("--split", choices=SPLITS, default="train")
            c.add_argument("--index", type=int, default=0)
            c.add_argument("--thinking", choices=TIERS, default="low")
        else:
            c.add_argument("job_id")
    return p


def config_from_args(a: argparse.Namespace) -> JobsConfig:
    return JobsConfig(redis_url=a.redis_url, db_url=a.db, workers=a.workers,
                      min_workers=a.workers if a.min_workers is None else a.min_workers,
                      max_workers=a.workers if a.max_workers is None else a.max_workers,
                      jobs_per_worker=a.jobs_per_worker, scale_down_delay_s=a.scale_down_delay, claim_timeout_s=a.claim_timeout,
                      max_attempts=a.max_attempts, max_turns=a.max_turns, max_new_tokens_per_turn=a.max_new_tokens,
                      policy_url=a.policy_url, job_timeout_s=a.job_timeout, rate_limit_per_s=a.rate_limit_per_s,
                      rate_limit_burst=a.rate_limit_burst)


def _client(url: str, api_key: str | None):
    import httpx

    key = api_key if api_key is not None else os.environ.get(JOBS_KEY_ENV)
    headers = {} if key is None else {"Authorization": f"Bearer {check_key(key, '--api-key' if api_key is not None else f'${JOBS_KEY_ENV}')}"}
    return httpx.Client(base_url=url, timeout=30, headers=headers)


def _print(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.cmd is None:
        build_parser().print_help()
        return 2
    if args.cmd == "serve":
        try:
            cfg = config_from_args(args)
            keys = keys_from(args.api_key, os.environ)
            from rl.jobs.server import check_access

            check_access(args.host, keys)
        except ConfigError as e:
            print(f"jointrl jobs: config error: {e}", file=sys.stderr)
            return 2
        from rl.jobs.server import serve
        from rl.model_arg import ModelArgError, resolve_model

        try:  # the policy server (local, or at policy_url) loads the model; a local one needs its directory here
            model = args.model if cfg.policy_url else str(resolve_model(args.model).checkpoint())
        except ModelArgError as e:
            print(f"jointrl jobs: {e}", file=sys.stderr)
            return 2
        try:
            return serve(model, args.port, cfg, host=args.host, api_keys=keys)
        except ConfigError as e:
            print(f"jointrl jobs: config error: {e}", file=sys.stderr)
            return 2
    try:
        client = _client(args.url, args.api_key)
    except ConfigError as e:
        print(f"jointrl jobs {args.cmd}: config error: {e}", file=sys.stderr)
        return 2
    with client as c:
        if args.cmd == "submit":
            r = c.post("/v1/jobs", json={"env": args.env, "split": args.split, "index": args.index, "thinking": args.thinking})
        elif args.cmd == "status":
            r = c.get(f"/v1/jobs/{args.job_id}")
        elif args.cmd == "cancel":
            r = c.delete(f"/v1/jobs/{args.job_id}")
        else:
            return _watch(c, args.job_id)
        if r.status_code >= 400:
            print(f"jointrl jobs {args.cmd}: HTTP {r.status_code}: {r.text}", file=sys.stderr)
            return 2 if r.status_code in (400, 422) else 1
        _print(r.json())
        return 0


def _watch(c, job_id: str) -> int:  # noqa: ANN001 - an httpx.Client
    final = None
    with c.stream("GET", f"/v1/jobs/{job_id}/events", timeout=None) as r:
        if r.status_code >= 400:
            print(f"jointrl jobs watch: HTTP {r.status_code}: {r.read().decode()}", file=sys.stderr)
            return 1
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[len("data: "):])
                print(json.dumps(ev, sort_keys=True), flush=True)
                if ev["kind"] in ("done", "failed", "cancelled", "dead_letter"):
                    final = ev["kind"]
    return 0 if final == "done" else 1
