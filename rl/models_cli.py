"""`jointrl models pull NAME` and `jointrl models list`: the command line over model/hub.py.

`pull` prints progress to stderr and the checkpoint directory as the last line of stdout, so scripts can
take `$(jointrl models pull smollm2-135m | tail -1)`. `list` prints one row per pullable model: name,
parameters, size on disk, whether it is cached, and its directory. Nothing else lives here.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from types import ModuleType


def light_hub() -> ModuleType:
    """model/hub.py, loaded without running model/__init__.py.

    The registry and the cache checks need only the standard library, but `from model import hub` first runs the
    package's __init__, which imports torch and transformers and registers the HybridMoe classes: 7-20 s on a
    busy 2-core machine, all of `jointrl models list`'s time and most of a dry run's. The module is registered
    under its own name, so a later `from model import hub` (a pull, which converts with torch) finds this one.
    """
    if "model.hub" in sys.modules:
        return sys.modules["model.hub"]
    pkg = importlib.util.find_spec("model")  # finds the package without importing it
    if pkg is None or not pkg.submodule_search_locations:
        from model import hub

        return hub
    spec = importlib.util.spec_from_file_location("model.hub", f"{list(pkg.submodule_search_locations)[0]}/hub.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["model.hub"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["model.hub"]
        raise
    return mod


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_cmd", metavar="{pull,list}", required=True)
    pull = sub.add_parser("pull", help="download and convert a pretrained model into the cache; prints its directory last")
    pull.add_argument("name", help="a name from `jointrl models list` (e.g. smollm2-135m, smollm2-135m-moe)")
    sub.add_parser("list", help="pullable models: name, size, cached or not, directory")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def main(args: argparse.Namespace) -> int:
    hub = light_hub()

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

