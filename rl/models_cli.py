"""`jointrl models pull NAME` and `jointrl models list`: the command line over model/hub.py.

`pull` prints progress to stderr and the checkpoint directory as the last line of stdout, so scripts can
take `$(jointrl models pull smollm2-135m | tail -1)`. `list` prints one row per pullable model: name,
parameters, size on disk, whether it is cached, and its directory. Nothing else lives here.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_cmd", metavar="{pull,list}", required=True)
    pull = sub.add_parser("pull", help="download and convert a pretrained model into the cache; prints its directory last")
    pull.add_argument("name", help="a name from `jointrl models list` (e.g. smollm2-135m, smollm2-135m-moe)")
    sub.add_parser("list", help="pullable models: name, size, cached or not, directory")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def main(args: argparse.Namespace) -> int:
    from model import hub

    if args.models_cmd == "list":
        rows = [("name", "params", "disk", "cached", "path")]
        for m in hub.list_models():
            cached = "yes" if m.cached else ("no" + (f" (downloads {_size(m.download_bytes)})" if m.download_bytes else ""))
            rows.append((m.name, f"{m.num_params / 1e6:.0f}M", _size(m.disk_bytes), cached, str(m.path)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
        return 0
    try:
        path = hub.pull(args.name, progress=lambda msg: print(f"jointrl models pull: {msg}", file=sys.stderr, flush=True))
    except hub.PullError as e:
        print(f"jointrl models pull: {e}", file=sys.stderr)
        return 2 if args.name not in hub.names() else 1
    print(path)
    return 0

