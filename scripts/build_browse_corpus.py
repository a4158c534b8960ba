"""Build (or rebuild) the generated browsing corpus and its search index, with a progress bar.

    .venv/bin/python scripts/build_browse_corpus.py                 # the browse-v0 corpus: 10,000 pages, seed 0
    .venv/bin/python scripts/build_browse_corpus.py --pages 500     # the browse-small-v0 corpus
    .venv/bin/python scripts/build_browse_corpus.py --pages 20000 --seed 3 --rebuild

The corpus lands in $JOINTRL_CACHE/browse/ (default .cache/browse/ in the repo). Environments build
it on first use anyway; this script is for doing that ahead of time and for inspecting the result.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.browse.build import DEFAULT_PAGES, load_or_build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=DEFAULT_PAGES, help="entity pages to generate (list pages come on top)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--questions", type=int, default=None, help="number of questions (default: pages / 4)")
    ap.add_argument("--cache-dir", default=None, help="cache root (default: $JOINTRL_CACHE or .cache/)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if a cached copy exists")
    args = ap.parse_args(argv)
    if args.pages < 50:
        ap.error(f"--pages must be >= 50, got {args.pages}")
    t0 = time.perf_counter()
    built = load_or_build(args.pages, args.seed, args.questions, cache_dir=args.cache_dir, progress=True,
                          rebuild=args.rebuild)
    qs = built.corpus.questions()
    hops = collections.Counter(q.hops for q in qs)
    splits = collections.Counter(q.split for q in qs)
    print(f"corpus {built.corpus.name}: {len(built.corpus.paths())} pages, {len(qs)} questions "
          f"(hops {dict(sorted(hops.items()))}, splits {dict(splits)}, "
          f"{sum(q.injected for q in qs)} with an injected page on the path) at {built.root} "
          f"[{time.perf_counter() - t0:.1f} s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
