"""The one reading of a model argument: `model.arch` / `model.reference` of `jointrl train`, the checkpoint of
`jointrl eval`, MODEL of `jointrl serve` and `jointrl jobs serve`.

A model argument is, tried in this order:
- a URL (`file://`, `s3://`, ...) of weights `jointrl export --to` wrote: pulled into the cache
  (rl/weights/objstore.py), kind `url`;
- a checkpoint directory (it holds config.json), or a run's checkpoint directory (its `hf/` holds one),
  kind `checkpoint`;
- a pullable pretrained model's name (`jointrl models list`): its directory, pulled on first use (cached,
  file-locked, offline after the first pull), kind `pullable`;
- anything else, kind `shipped`: a shipped model config name (tiny, small, full) or a model config JSON
  file, given random weights by `ModelArg.build` (a run builds them in its run directory with `model.seed`,
  the servers in the cache); an unknown name fails there, naming every form above.

So one name means the same model to every command. What this module does not do: load weights, or pick a
chat format or an engine. It stays light (no torch) until a URL is pulled or a shipped model is built.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["url", "checkpoint", "pullable", "shipped"]


class ModelArgError(ValueError):
    """A model argument that names no model, or a pull that failed; the message says which forms exist."""


def _forms(hub_names: tuple[str, ...]) -> str:
    return ("neither a shipped model config (tiny, small, full) or model config JSON, a pullable model "
            f"{list(hub_names)} (`jointrl models list`), a checkpoint directory with config.json (or a run's, with "
            "hf/config.json), nor a file:// / s3:// URL of exported weights")


@dataclass(frozen=True)
class ModelArg:
    """A resolved model argument."""

    given: str
    kind: Kind
    path: Path | None  # the checkpoint directory; None for `shipped` (see `build`) and for a pullable not on this machine with pull=False

    @property
    def name(self) -> str:
        """The name a server answers to: the name as given, or a checkpoint directory's own name."""
        if self.kind == "checkpoint":
            return Path(self.given).resolve().name
        return Path(self.given).stem if self.kind == "shipped" and self.given.endswith(".json") else self.given

    def checkpoint(self, seed: int = 0, cache_dir: str | Path | None = None) -> Path:
        """The checkpoint directory a server loads: `path`, or a shipped config's random weights of `seed`,
        built once in `cache_dir` (default: the cache's serve/) as `<name>-seed<seed>`."""
        from jointrl.paths import cache_root

        root = Path(cache_dir) if cache_dir else cache_root() / "serve"
        return self.build(root / f"{self.name}-seed{seed}", seed)

    def build(self, out_dir: str | Path, seed: int) -> Path:
        """The checkpoint directory: `path`, or for `shipped` random weights (torch seed `seed`) built in `out_dir`."""
        if self.path is not None:
            return self.path
        if self.kind != "shipped":
            raise ModelArgError(f"{self.given!r} ({self.kind}) is not on this machine yet")
        from model.shipped import SHIPPED_CONFIGS, build_random_checkpoint

        if self.given not in SHIPPED_CONFIGS and not (self.given.endswith(".json") and Path(self.given).is_file()):
            from rl.models_cli import light_hub

            raise ModelArgError(f"{self.given!r} is {_forms(light_hub().names())}")
        return build_random_checkpoint(self.given, out_dir, seed)


def resolve_model(value: str, *, pull: bool = True, what: str = "MODEL") -> ModelArg:
    """Read `value` (see the module docstring). `pull=False` (a dry run) pulls nothing: a URL or a pullable model
    not on this machine comes back with `path=None`. `what` names the argument in errors (e.g. `config key
    'model.arch'`)."""
    if "://" in value:
        from jointrl.paths import cache_root

        dest = cache_root() / "weights" / hashlib.sha256(value.encode()).hexdigest()[:16]
        if pull:
            from rl.weights.objstore import pull as pull_shards

            pull_shards(value, dest)
        return ModelArg(value, "url", dest if pull else None)
    p = Path(value)
    for ckpt in (p, p / "hf"):
        if (ckpt / "config.json").is_file():
            return ModelArg(value, "checkpoint", ckpt)
    from rl.models_cli import light_hub

    hub = light_hub()
    if value not in hub.names():
        return ModelArg(value, "shipped", None)
    if not pull:
        return ModelArg(value, "pullable", hub.local_path(value) if hub.is_cached(value) else None)
    if not hub.is_cached(value):
        print(f"{what}: pulling {value} (first use; `jointrl models pull {value}`)", file=sys.stderr, flush=True)
    try:
        return ModelArg(value, "pullable", Path(hub.pull(value)))
    except hub.PullError as e:
        raise ModelArgError(f"{what}: {value!r} names a pullable model, and pulling it failed: {e}") from e
