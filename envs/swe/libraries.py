"""The source libraries of swe-v0: pinned sdists fetched with pip, their licences, layouts and test runs.

Each `Library` names a small pure-Python project whose source distribution ships its tests
(docs/platform.md: toolz, cachetools, tabulate, more-itertools). `ensure_source(lib)` downloads the pinned
sdist with `pip download --no-binary NAME --no-deps` into the cache (`$JOINTRL_CACHE/swe` or
`.cache/swe`), checks its sha256 and unpacks it once; nothing from these projects is committed to
this repository. `ensure_runtime()` assembles the *test runtime*: a directory holding pytest and
its pure-Python dependencies copied out of the project's venv, plus `driver.py` and `worker.py`
(runner.py: the judge and the worker), so a sandbox can run pytest from a read-only mount
without the venv's site-packages (which hold other copies of cachetools / more-itertools that a
deleted package would silently fall back to).

What this module does not do: inject bugs (mutate.py), run or validate suites (runner.py,
build.py), or grade (grader.py).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from jointrl import paths
from jointrl.digest import sha256_file

# Bump when the layout of the cached sources or runtime changes (it is part of their paths).
CACHE_LAYOUT = "v1"


@dataclass(frozen=True)
class Library:
    """A pinned source library and how its tests run.

    import_root: directory (relative to the unpacked sdist) that goes on sys.path ("" or "src").
    packages: the library's package directories (relative paths); only `.py` files inside them
        (outside `test_dirs`) are library code: mutated at build time, and the only agent edits
        that grading applies.
    test_dirs: directories holding the tests; the suite is every `test_*.py` under them.
    deselect: node ids left out of every run (slow: the whole suite must stay under 10 s, or
        timing / thread dependent: nondeterministic), decided from `--durations` runs.
    mutate_exclude: library files never mutated (version stubs, compatibility shims).
    """

    name: str  # distribution name on PyPI
    version: str
    sha256: str
    licence: str
    import_root: str
    packages: tuple[str, ...]
    test_dirs: tuple[str, ...]
    deselect: tuple[str, ...] = ()
    mutate_exclude: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    def is_test_path(self, rel: str) -> bool:
        parts = rel.split("/")
        return (any(rel == d or rel.startswith(d + "/") for d in self.test_dirs)
                or "tests" in parts[:-1] or "test" in parts[:-1] or parts[-1].startswith("test_")
                or parts[-1] == "conftest.py")

    def is_library_path(self, rel: str) -> bool:
        """True for a `.py` file the grader takes from the agent: inside a package dir, not a test,
        not a file Python or pytest would execute on its own (conftest / sitecustomize / usercustomize)."""
        name = rel.rsplit("/", 1)[-1]
        return (rel.endswith(".py") and any(rel.startswith(p + "/") for p in self.packages)
                and not self.is_test_path(rel)
                and name not in ("conftest.py", "sitecustomize.py", "usercustomize.py"))


# Versions pinned on 2026-11-30 (the newest sdists then); sha256 of the sdist as PyPI served it.
LIBRARIES: dict[str, Library] = {lib.name: lib for lib in (
    Library("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            licence="BSD-3-Clause", import_root="", packages=("toolz", "tlz"),
            test_dirs=("toolz/tests", "toolz/sandbox/tests"),
            mutate_exclude=("toolz/_version.py", "toolz/compatibility.py", "tlz/_build_tlz.py")),
    Library("cachetools", "8.0.2", "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0",
            licence="MIT", import_root="src", packages=("src/cachetools",), test_dirs=("tests",),
            # Threads racing on purpose: pass/fail may depend on scheduling.
            deselect=("tests/test_threading.py",)),
    Library("tabulate", "0.10.0", "e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d",
            licence="MIT", import_root="", packages=("tabulate",), test_dirs=("test",),
            # Spawns `python -m tabulate` subprocesses: slow and sensitive to the interpreter's flags.
            deselect=("test/test_cli.py",), mutate_exclude=("tabulate/version.py",)),
    Library("more-itertools", "11.2.1", "cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63",
            licence="MIT", import_root="", packages=("more_itertools",), test_dirs=("tests",),
            # From `--durations`: these take 0.3-27 s each (test_primes alone 27 s) or race threads.
            deselect=("tests/test_recipes.py::PrimeFunctionTests",
                      "tests/test_recipes.py::PolynomialFromRootsTests::test_large",
                      "tests/test_recipes.py::RunningMedianTests::test_vs_statistics_median",
                      "tests/test_recipes.py::FactorTests::test_cross_check",
                      "tests/test_more.py::DiscreteFourierTransformTests::test_roundtrip",
                      "tests/test_more.py::TestConcurrentTee",
                      "tests/test_more.py::TestSerialize",
                      "tests/test_more.py::TestSynchronized",
                      "tests/test_more.py::ExtractTests::test_all_orderings",
                      "tests/test_more.py::ExtractTests::test_early_free",
                      "tests/test_more.py::TestRandomOrderedRange::test_lcg_mitigation",
                      "tests/test_more.py::TestSubfactorial::test_vs_derangements",
                      "tests/test_more.py::DistinctPermutationsTests::test_r")),
)}


def get_library(name: str) -> Library:
    try:
        return LIBRARIES[name]
    except KeyError:
        raise KeyError(f"unknown swe library {name!r}; known: {', '.join(sorted(LIBRARIES))}") from None


def cache_root() -> Path:
    return paths.cache_root() / "swe"


def sdist_path(lib: Library) -> Path:
    """The pinned sdist in the cache, downloaded with pip if missing (needs PyPI; ~20-90 s per sdist)."""
    d = cache_root() / "sdists"
    d.mkdir(parents=True, exist_ok=True)
    found = [p for p in d.glob(f"*-{lib.version}.tar.gz")
             if re.sub(r"[-_.]+", "-", p.name[: -len(f"-{lib.version}.tar.gz")]).lower() == lib.name]
    if not found:
        tmp = Path(tempfile.mkdtemp(prefix="dl-", dir=d))
        try:
            # `--no-binary NAME` (not `:all:`): only this package must come as an sdist; its build
            # backend (setuptools_scm etc.) installs as wheels in pip's isolated build env. With the
            # venv's own setuptools (--no-build-isolation), a fresh venv lacks setuptools_scm, the
            # metadata says version 0.0.0 and pip refuses the download.
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", lib.name, "--no-deps",
                                "--disable-pip-version-check", "-d", str(tmp),
                                f"{lib.name}=={lib.version}"], capture_output=True, text=True, timeout=900)
            got = list(tmp.glob("*.tar.gz"))
            if r.returncode != 0 or len(got) != 1:
                raise RuntimeError(f"pip download of {lib.name}=={lib.version} failed (exit {r.returncode}): "
                                   f"{(r.stderr or r.stdout)[-1500:]}")
            os.replace(got[0], d / got[0].name)
            found = [d / got[0].name]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    path = found[0]
    digest = sha256_file(path)
    if digest != lib.sha256:
        raise RuntimeError(f"{path} has sha256 {digest}, but {lib.key} is pinned to {lib.sha256}; "
                           f"delete the file to fetch it again")
    return path


def ensure_source(lib: Library) -> Path:
    """The unpacked, pristine source tree of `lib` (read-only by convention; copy before editing)."""
    dst = cache_root() / "src" / CACHE_LAYOUT / lib.key
    if (dst / ".complete").exists():
        return dst
    sdist = sdist_path(lib)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=lib.key + ".tmp", dir=dst.parent))
    try:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")  # refuses absolute paths, links out of the tree, devices
        (top,) = [p for p in tmp.iterdir() if p.is_dir()]
        for junk in list(top.rglob("__pycache__")) + list(top.glob("*.egg-info")):
            shutil.rmtree(junk, ignore_errors=True)
        (top / ".complete").write_text(lib.sha256 + "\n")
        for p in [top, *top.rglob("*")]:  # readable by the sandbox uids that mount or copy it
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        try:
            os.rename(top, dst)
        except OSError:  # a concurrent process unpacked it first
            if not (dst / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def source_files(lib: Library, root: Path | None = None) -> dict[str, bytes]:
    """Every regular file of the pristine tree: relative path -> bytes (no `.complete` marker)."""
    root = ensure_source(lib) if root is None else root
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name != ".complete":
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def library_files(lib: Library, files: dict[str, bytes]) -> list[str]:
    return sorted(p for p in files if lib.is_library_path(p))


def mutable_files(lib: Library, files: dict[str, bytes]) -> list[str]:
    return [p for p in library_files(lib, files) if p not in lib.mutate_exclude]


def test_files(lib: Library, files: dict[str, bytes]) -> list[str]:
    return sorted(p for p in files if any(p.startswith(d + "/") for d in lib.test_dirs))


def grading_files(lib: Library, files: dict[str, bytes]) -> dict[str, bytes]:
    """What a test run needs: the package and test directories only (no setup.cfg / tox.ini / pytest.ini)."""
    roots = tuple(lib.packages) + tuple(lib.test_dirs)
    return {p: b for p, b in files.items() if any(p.startswith(r + "/") for r in roots) and "__pycache__" not in p}


# ----------------------------------------------------------------------------- the test runtime
# pytest 9's own dependencies on Python 3.11 (exceptiongroup / tomli are for older Pythons).
RUNTIME_DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")


def interpreter() -> Path:
    """The real interpreter behind the project's venv (the venv's `python` is a link to it)."""
    base = Path(sys.base_prefix)
    exe = base / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if not exe.exists():
        raise RuntimeError(f"cannot find the base interpreter at {exe}")
    return exe


def ensure_runtime() -> Path:
    """`<cache>/swe/runtime/<layout>-<hash>/{site/, driver.py, worker.py}`: pytest and friends + the judge and worker."""
    from envs.swe import runner

    files: dict[str, bytes] = {"driver.py": runner.JUDGE_SOURCE.encode(), "worker.py": runner.WORKER_SOURCE.encode()}
    # Wrappers for the agent's shell: `python` / `pytest` run the project's interpreter with the
    # runtime on PYTHONPATH (set by the domain). Their content names the interpreter's path, so
    # the runtime's hash changes with the machine's interpreter.
    exe = interpreter()
    files["bin/python"] = f'#!/bin/sh\nexec {exe} "$@"\n'.encode()
    files["bin/python3"] = files["bin/python"]
    files["bin/pytest"] = f'#!/bin/sh\nexec {exe} -m pytest -p no:cacheprovider "$@"\n'.encode()
    for dist_name in RUNTIME_DISTRIBUTIONS:
        dist = importlib.metadata.distribution(dist_name)
        for f in dist.files or ():
            rel = f.as_posix()
            if rel.startswith("..") or ".dist-info/" in rel or "__pycache__" in rel or rel.startswith("bin/"):
                continue
            src = Path(dist.locate_file(f))
            if src.is_file():
                files["site/" + rel] = src.read_bytes()
    h = hashlib.sha256()
    for k in sorted(files):
        h.update(k.encode() + b"\0" + hashlib.sha256(files[k]).digest())
    dst = cache_root() / "runtime" / f"{CACHE_LAYOUT}-{h.hexdigest()[:12]}"
    if (dst / ".complete").exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="rt.tmp", dir=dst.parent))
    try:
        for rel, data in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        (tmp / ".complete").write_text("ok\n")
        for p in [tmp, *tmp.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() or p.parent.name == "bin" else 0o644)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not (dst / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
