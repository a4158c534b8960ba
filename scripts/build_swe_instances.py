"""Build (or rebuild) the swe-v0 instance set and cache it as a `datasets` dataset.

    .venv/bin/python scripts/build_swe_instances.py                # the full set (>= 200 instances)
    .venv/bin/python scripts/build_swe_instances.py --small        # the 12-instance set the tests use
    .venv/bin/python scripts/build_swe_instances.py --n 60 --libraries toolz cachetools

Downloads the pinned sdists on first use (PyPI), validates candidates in `--workers` processes
with a progress bar, and prints the build report (accepted, rejections per reason, time). The
result lands under `$JOINTRL_CACHE/swe/instances/` (default `.cache/swe/instances/`), where
`envs.swe` finds it: swe-v0 serves the full set when it is built, the small set otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.swe import build as B  # noqa: E402
from envs.swe import libraries as L  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="build the small default-test set instead of the full one")
    ap.add_argument("--n", type=int, default=None, help="total instances (20%% held out); default: the spec's")
    ap.add_argument("--libraries", nargs="+", default=None, choices=sorted(L.LIBRARIES))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if the set is cached")
    ap.add_argument("--verify", action="store_true",
                    help="after building, grade every instance in the bubblewrap sandbox: the reference patch must "
                         "resolve it and the empty patch must not (needs root)")
    ap.add_argument("--verify-sample", type=int, default=None, metavar="K",
                    help="verify only K instances drawn at random (seeded), e.g. for a quick check of a full set")
    a = ap.parse_args(argv)
    spec = B.SMALL if a.small else B.FULL
    if a.n is not None:
        if a.n < 2:
            ap.error("--n must be at least 2 (one train and one held-out instance)")
        held = max(1, round(a.n * B.HELDOUT_FRACTION))
        spec = dataclasses.replace(spec, n_train=a.n - held, n_heldout=held)
    if a.libraries:
        spec = dataclasses.replace(spec, libraries=tuple(a.libraries))
    spec = dataclasses.replace(spec, workers=a.workers, seed=a.seed)
    if spec != (B.SMALL if a.small else B.FULL):
        spec = dataclasses.replace(spec, name=f"custom-{spec.name}")
    rc = 0
    if B.load(spec) is not None and not a.force:
        print(f"already built: {spec.path()}")
        print((spec.path() / "build_report.json").read_text())
    else:
        instances, report = B.build(spec, progress=True)
        path = B.save(spec, instances, report)
        print(json.dumps(report, indent=1))
        print(f"saved {len(instances)} instances to {path}")
        if len(instances) < spec.n_train + spec.n_heldout:
            print(f"warning: only {len(instances)} of {spec.n_train + spec.n_heldout} instances found", file=sys.stderr)
            rc = 1
    if a.verify or a.verify_sample:
        insts = B.load(spec) or []
        if a.verify_sample is not None and a.verify_sample < len(insts):
            import random

            insts = random.Random(0).sample(insts, a.verify_sample)
        rc = verify(insts) or rc
    return rc


def verify(instances: list[B.Instance]) -> int:
    """Reference patch resolves, empty patch does not: the grading path, in the sandbox, 2 at a time."""
    import concurrent.futures
    import time

    from tqdm import tqdm

    from envs.sandbox.bwrap import BwrapBackend
    from envs.swe import grader as G
    from envs.swe import instances as I
    from envs.swe.tasks import task_of

    backend = BwrapBackend()

    def one(inst: B.Instance) -> str | None:
        task = task_of(inst)
        lib = I.task_library(task)
        start = I.agent_repo(task)
        lib_files = {p: b for p, b in start.items() if lib.is_library_path(p)}
        empty = G.verdict(G.run_in_sandbox(backend, lib, I.grading_tree(task, lib_files)), inst.fail_to_pass, inst.pass_to_pass)
        lib_files[inst.mutation.path] = I.pristine(lib.name)[inst.mutation.path]
        ref = G.verdict(G.run_in_sandbox(backend, lib, I.grading_tree(task, lib_files)), inst.fail_to_pass, inst.pass_to_pass)
        if not ref.resolved:
            return f"{inst.instance_id}: reference patch does not resolve it ({ref})"
        if empty.resolved or empty.f2p_passed:
            return f"{inst.instance_id}: the empty patch passes {empty.f2p_passed} FAIL_TO_PASS tests"
        return None

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        problems = [p for p in tqdm(ex.map(one, instances), total=len(instances), desc="verify") if p]
    for p in problems:
        print("FAIL", p)
    print(f"verified {len(instances)} instances in {time.monotonic() - t0:.0f} s: "
          f"{len(instances) - len(problems)} ok, {len(problems)} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
