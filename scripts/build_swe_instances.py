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
    if B.load(spec) is not None and not a.force:
        print(f"already built: {spec.path()}")
        print((spec.path() / "build_report.json").read_text())
        return 0
    instances, report = B.build(spec, progress=True)
    path = B.save(spec, instances, report)
    print(json.dumps(report, indent=1))
    print(f"saved {len(instances)} instances to {path}")
    if len(instances) < spec.n_train + spec.n_heldout:
        print(f"warning: only {len(instances)} of {spec.n_train + spec.n_heldout} instances found", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
