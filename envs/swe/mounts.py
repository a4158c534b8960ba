"""What a swe-v0 sandbox (the agent's and the grader's) sees of the host: an allowlist.

Grading needs the interpreter, its standard library, the pytest runtime, and for the agent's
shell the usual programs; nothing else of the host is mounted. In particular no `site-packages`
or `dist-packages` anywhere, no `ensurepip` / `python-wheels` bundles and no standard-library
`test` data: those hold vendored copies of the very libraries the tasks are built from (setuptools
vendors more-itertools; pip, the Google Cloud SDK and others vendor more), i.e. the unmutated
source an agent could copy instead of fixing the bug.

* `/usr`: only `/usr/bin`, the shared libraries (`/usr/lib/<multiarch>`, `/usr/lib64`), git's
  helpers and templates, the locale archive, and the standard library of the executor's
  `/usr/bin/python3`, with the directories above hidden (a bubblewrap `UsrView`).
* the base interpreter of the project's venv: its binary, `libpython` and standard library, at
  their own paths (under `/usr` through the same view; elsewhere, e.g. pyenv under `/root`,
  as read-only `Mount`s with the same directories covered by an empty directory).
* the pytest runtime (libraries.ensure_runtime) at `RUNTIME_INSIDE`.

What this does not do: it does not decide which files of the agent are graded (grader.py) nor
isolate processes (envs/sandbox/). On a backend other than bubblewrap the `/usr` view is not
applied (`open_sandbox` / `open_pristine` pass it to bubblewrap only): such a backend decides
its own root.
"""
from __future__ import annotations

import functools
import glob
import os
import sysconfig
from pathlib import Path
from typing import Any, Mapping

from envs.sandbox.base import Mount, Sandbox, SandboxBackend, SandboxLimits
from envs.swe import libraries as L

RUNTIME_INSIDE = "/opt/swe"
# Inside any allowed Python library directory: what may hold third-party or vendored code.
HIDDEN_IN_STDLIB = ("site-packages", "dist-packages", "ensurepip", "test", "idlelib")
USR_ALLOW_FIXED = ("/usr/bin", "/usr/lib64", "/usr/lib/git-core", "/usr/libexec/git-core", "/usr/share/git-core",
                   "/usr/lib/locale")


@functools.lru_cache(maxsize=1)
def interpreter_paths() -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """(paths to show, paths to hide inside them) for the venv's base interpreter."""
    exe = L.interpreter().resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    show = [exe, stdlib]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        show.append((Path(libdir) / soname).resolve())
    hide = [stdlib / h for h in HIDDEN_IN_STDLIB if (stdlib / h).exists()]
    return tuple(show), tuple(hide)


def _under_usr(p: Path) -> bool:
    return str(p).startswith("/usr/")


@functools.lru_cache(maxsize=1)
def usr_view():
    """The bubblewrap `UsrView` of every swe-v0 sandbox."""
    from envs.sandbox.bwrap import BwrapConfig, UsrView

    allow = list(USR_ALLOW_FIXED) + sorted(glob.glob("/usr/lib/*-linux-gnu*"))
    executor = os.path.realpath(BwrapConfig().python)  # e.g. /usr/bin/python3.11: its stdlib below
    name = os.path.basename(executor)
    pylibs = [d for d in (f"/usr/lib/{name}", f"/usr/lib64/{name}") if os.path.isdir(d)]
    allow += pylibs
    show, hide = interpreter_paths()
    allow += [str(p) for p in show if _under_usr(p)]
    hidden = [f"{d}/{h}" for d in pylibs for h in HIDDEN_IN_STDLIB]
    hidden += [str(p) for p in hide if _under_usr(p)]
    allow = [a for a in allow if os.path.lexists(a)]
    hidden = [h for h in hidden if os.path.lexists(h) and any(h.startswith(a + "/") for a in allow)]
    return UsrView(allow=tuple(allow), hide=tuple(hidden))


def empty_dir() -> Path:
    """An empty directory to mount over hidden paths outside /usr."""
    d = L.cache_root() / "empty"
    d.mkdir(parents=True, exist_ok=True)
    if any(d.iterdir()):  # it is what a hidden directory shows
        raise RuntimeError(f"{d} must be empty")
    os.chmod(d, 0o555)
    return d


def test_mounts() -> tuple[Mount, ...]:
    """Read-only mounts of every swe-v0 sandbox: the pytest runtime and the interpreter outside /usr."""
    return _test_mounts(str(L.cache_root()))


@functools.lru_cache(maxsize=4)  # per cache root: assembling the runtime hashes every file of pytest
def _test_mounts(cache_root: str) -> tuple[Mount, ...]:
    mounts = [Mount(host=L.ensure_runtime(), inside=RUNTIME_INSIDE)]
    show, hide = interpreter_paths()
    mounts += [Mount(host=p, inside=str(p)) for p in show if not _under_usr(p)]
    if any(not _under_usr(p) for p in hide):
        empty = empty_dir()
        mounts += [Mount(host=empty, inside=str(p)) for p in hide if not _under_usr(p)]
    return tuple(mounts)


def open_sandbox(backend: SandboxBackend, *, limits: SandboxLimits, files: Mapping[str, bytes]) -> Sandbox:
    """A swe-v0 sandbox (the agent's, or a non-pristine grading one) with the mounts above."""
    return backend.open(limits=limits, files=files, mounts=test_mounts(), **_usr(backend))


def open_pristine(backend: SandboxBackend, *, limits: SandboxLimits, files: Mapping[str, bytes]) -> Sandbox:
    """A fresh grading sandbox (`open_pristine`, nothing of the agent's) with the mounts above."""
    return backend.open_pristine(agent=None, files=files, limits=limits, mounts=test_mounts(), **_usr(backend))


def _usr(backend: SandboxBackend) -> dict[str, Any]:
    # The /usr allowlist is a bubblewrap option; another backend decides its own root.
    from envs.sandbox.bwrap import BwrapBackend

    return {"usr": usr_view()} if isinstance(backend, BwrapBackend) else {}
