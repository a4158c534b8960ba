"""The environment registry: versioned ids -> (env factory, task generator), plus cached task sets.

- `register(env_id, factory, task_fn)`: ids look like `terminal-v0`; registering a different
  factory under a taken id is refused (bump the version instead).
- Discovery: the first lookup loads every entry point of the group `jointrl.envs` (this repo
  declares `builtin = "envs.builtin:register_all"`; a domain in another package declares its own).
  An entry point that fails to load is skipped, and the reason is kept (`discovery_errors()`,
  shown by `jointrl envs list`), so one broken plug-in does not take every domain down.
- `make(env_id, **kw) -> Env` calls the factory.
- `EnvSpec.default_mix`: False for a domain a run should name on purpose, never pick up in a generated
  mix of every domain (scripts/many_domains_config.py): e.g. one whose best constant answer scores
  >= 0.2 on held-out tasks (`envs.check`), with the measured prior in `EnvSpec.note`.
- `tasks(env_id, split, seed=0, n=None) -> datasets.Dataset`: rows are `Task.to_row()` dicts;
  turn a row into a `Task` with `envs.Task.from_row(row)`. Generation is deterministic in
  (split, seed, n); the result is cached on disk under `$JOINTRL_CACHE/envs` (or `.cache/envs` in
  the repo), keyed by a fingerprint of the generator's source files so edits invalidate it.
  Splits: "train" and "heldout" (held-out instances use parameters never seen in train: that is
  the task generator's contract, and `check_env` verifies it on `Task.private["variant"]`).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from jointrl.records import Task
from jointrl import paths

if TYPE_CHECKING:
    import datasets

    from envs.base import Env

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "jointrl.envs"
SPLITS = ("train", "heldout")
_ID_RE = re.compile(r"^[a-z][a-z0-9_]*(-[a-z0-9_]+)*-v\d+$")

TaskFn = Callable[[str, int, "int | None"], Sequence[Task]]  # (split, seed, n) -> tasks


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    factory: Callable[..., "Env"]
    task_fn: TaskFn
    description: str = ""
    source_files: tuple[Path, ...] = field(default=())  # hashed into the task-cache key
    default_mix: bool = True  # False: left out of generated all-domain mixes (see the module docstring)
    note: str = ""            # why it is out of the default mix (e.g. its constant-answer prior)


class RegistryError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return str(self.args[0]) if self.args else ""


_REGISTRY: dict[str, EnvSpec] = {}
_DISCOVERY_ERRORS: dict[str, str] = {}
_DISCOVERED = False
_LOCK = threading.RLock()


def register(env_id: str, factory: Callable[..., "Env"], task_fn: TaskFn, *, description: str = "",
             source_files: Sequence[Path] = (), default_mix: bool = True, note: str = "") -> EnvSpec:
    """Register an environment. Re-registering the same factory and task_fn is a no-op."""
    if not _ID_RE.match(env_id):
        raise ValueError(f"env id {env_id!r} must look like 'name-v0' (lowercase, versioned with -v<N>)")
    if not callable(factory) or not callable(task_fn):
        raise TypeError(f"register({env_id!r}): factory and task_fn must be callable")
    if not source_files:
        mod = sys.modules.get(getattr(task_fn, "__module__", ""), None)
        mod_file = getattr(mod, "__file__", None)
        source_files = sorted(Path(mod_file).parent.glob("*.py")) if mod_file else ()
    if not default_mix and not note:
        raise ValueError(f"register({env_id!r}): a domain out of the default mix needs a note saying why")
    spec = EnvSpec(env_id, factory, task_fn, description, tuple(Path(p) for p in source_files), default_mix, note)
    with _LOCK:
        old = _REGISTRY.get(env_id)
        if old is not None:
            if old.factory is factory and old.task_fn is task_fn:
                return old
            raise ValueError(f"env id {env_id!r} is already registered (by {old.factory!r}); bump the version, e.g. "
                             f"{env_id.rsplit('-v', 1)[0]}-v{int(env_id.rsplit('-v', 1)[1]) + 1}")
        _REGISTRY[env_id] = spec
    return spec


def _discover() -> None:
    global _DISCOVERED
    with _LOCK:
        if _DISCOVERED:
            return
        _DISCOVERED = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()()
            except Exception as e:  # noqa: BLE001 - a broken plug-in is skipped and reported
                _DISCOVERY_ERRORS[ep.name] = f"{type(e).__name__}: {e}"
                log.warning("environment plug-in %r (%s) failed to load: %s", ep.name, ep.value, e)
        load_plugins([p for p in os.environ.get(PLUGINS_ENV, "").split(os.pathsep) if p])


PLUGINS_ENV = "JOINTRL_ENV_PLUGINS"  # os.pathsep-separated plug-ins (files or modules), loaded at discovery
_LOADED_PLUGINS: set[str] = set()


def load_plugins(plugins: Sequence[str]) -> None:
    """Register the domains of plug-ins that are neither built in nor packaged: each a path to a .py file or an
    importable module name; after import, its `register()` is called when it has one. This is how a domain in
    the author's own file joins without editing tracked files or packaging an entry point (`envs.plugins` in a
    run config, or $JOINTRL_ENV_PLUGINS for `jointrl envs check|play|list`). A plug-in that fails is skipped and
    reported in `discovery_errors()`, like a broken entry point. Loading one twice is a no-op."""
    import importlib
    import importlib.util

    for spec_text in plugins:
        key = str(Path(spec_text).resolve()) if spec_text.endswith(".py") else spec_text
        with _LOCK:
            if key in _LOADED_PLUGINS:
                continue
            _LOADED_PLUGINS.add(key)
        try:
            if spec_text.endswith(".py"):
                path = Path(key)
                if not path.is_file():
                    raise FileNotFoundError(f"no such plug-in file {spec_text!r}")
                name = f"jointrl_env_plugin_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
            else:
                mod = importlib.import_module(spec_text)
            if callable(getattr(mod, "register", None)):
                mod.register()
        except Exception as e:  # noqa: BLE001 - a broken plug-in is skipped and reported
            _DISCOVERY_ERRORS[f"plugin:{spec_text}"] = f"{type(e).__name__}: {e}"
            log.warning("environment plug-in %r failed to load: %s", spec_text, e)


def discovery_errors() -> dict[str, str]:
    _discover()
    from envs import builtin  # the built-in domains that were skipped (optional dependency missing)
    return {**_DISCOVERY_ERRORS, **{f"builtin:{k}": v for k, v in builtin.SKIPPED.items()}}


def spec(env_id: str) -> EnvSpec:
    _discover()
    with _LOCK:
        if env_id in _REGISTRY:
            return _REGISTRY[env_id]
        known = ", ".join(sorted(_REGISTRY)) or "none"
    raise RegistryError(f"unknown env id {env_id!r}; registered: {known}")


def list_envs() -> list[EnvSpec]:
    _discover()
    with _LOCK:
        return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def make(env_id: str, **kwargs: Any) -> "Env":
    return spec(env_id).factory(**kwargs)


def generate_tasks(env_id: str, split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    """Tasks straight from the generator (no cache). Validates the split and the result."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits are: {', '.join(SPLITS)}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    out = list(spec(env_id).task_fn(split, seed, n))
    for t in out:
        if not isinstance(t, Task):
            raise TypeError(f"{env_id}: the task generator returned {type(t).__name__}, not envs.Task")
        if t.split != split:
            raise ValueError(f"{env_id}: task {t.id} says split {t.split!r} but {split!r} was asked for")
    ids = [t.id for t in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{env_id}: the task generator returned duplicate task ids")
    return out


def cache_dir() -> Path:
    return paths.cache_root() / "envs"


def _fingerprint(s: EnvSpec) -> str:
    h = hashlib.sha256(s.env_id.encode())
    for p in s.source_files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def tasks(env_id: str, split: str, seed: int = 0, n: int | None = None, *, use_cache: bool = True) -> "datasets.Dataset":
    """The task set as a `datasets.Dataset` of `Task.to_row()` rows (see the module docstring)."""
    import datasets  # heavy: imported only when task sets are asked for

    s = spec(env_id)
    path = cache_dir() / env_id / f"{split}-seed{seed}-n{'all' if n is None else n}-{_fingerprint(s)}"
    if use_cache and (path / "dataset_info.json").exists():
        return datasets.load_from_disk(str(path))
    rows = [t.to_row() for t in generate_tasks(env_id, split, seed, n)]
    ds = datasets.Dataset.from_list(rows, features=_FEATURES()) if rows else datasets.Dataset.from_dict(
        {k: [] for k in _ROW_KEYS}, features=_FEATURES())
    if use_cache and len(ds):  # datasets cannot reload an empty saved set; an empty one is free to rebuild
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write next to the target and rename: concurrent processes never see a half-written set.
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp", dir=path.parent))
        try:
            ds.save_to_disk(str(tmp))
            try:
                os.rename(tmp, path)
            except OSError:  # another process won the race; its copy is identical
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return datasets.load_from_disk(str(path))
    return ds


_ROW_KEYS = ("id", "domain", "prompt", "public", "private", "limits", "thinking", "split")


def _FEATURES():  # noqa: N802 - built lazily so `import envs` does not import datasets
    import datasets

    return datasets.Features({k: datasets.Value("string") for k in _ROW_KEYS})
