"""Trusted-side access to directories an agent controls, without following anything it planted.

The host process (often root) reads the agent's work dir to grade it and writes set-up files into
it. A naive `open(workdir / path)` would follow a symlink the agent planted (`out -> /etc`) and
read or overwrite a host file. Every function here walks the path one component at a time with
`dir_fd` and `O_NOFOLLOW`, so a symlink anywhere on the path (parent directories included) is an
error; opens the final file with `O_NONBLOCK` (a FIFO cannot hang the reader) and accepts only
regular files; and caps sizes and counts.

What it does not do: it does not stop a *running* agent from changing files while they are read
(kill the sandbox first; the bwrap backend does so before grading), and it does not interpret
file contents.
"""
from __future__ import annotations

import os
import stat
from typing import Iterator, Mapping

# The records are part of the sandbox interface (base.py); re-exported here for the functions' callers.
from envs.sandbox.base import CopyReport, PathStat

__all__ = ["ArtifactError", "CopyReport", "PathStat", "copy_tree_as_data", "iter_regular_files", "list_files",
           "read_file", "split_relpath", "stat_path", "write_file"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ArtifactError(ValueError):
    """A path or file the trusted side refuses: traversal, a symlink, not a regular file, too big."""


def split_relpath(path: str, *, inside_prefix: str = "/work") -> list[str]:
    """Validate `path` (relative to the work dir, or absolute under `inside_prefix`) into components."""
    if not isinstance(path, str) or not path:
        raise ArtifactError(f"artifact path must be a non-empty str, got {path!r}")
    if "\x00" in path:
        raise ArtifactError(f"artifact path contains a NUL byte: {path!r}")
    if path.startswith("/"):
        prefix = inside_prefix.rstrip("/") + "/"
        if not path.startswith(prefix):
            raise ArtifactError(f"absolute artifact path {path!r} is not under {inside_prefix}")
        path = path[len(prefix):]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts:
        raise ArtifactError(f"artifact path {path!r} names the work dir itself, not a file")
    if any(p == ".." for p in parts):
        raise ArtifactError(f"artifact path {path!r} contains '..'")
    return parts


def _open_dir_chain(root_fd: int, dirs: list[str], *, create_mode: int | None = None,
                    owner: tuple[int, int] | None = None) -> int:
    """Open (optionally creating) each directory under `root_fd` without following symlinks."""
    fd = os.dup(root_fd)
    try:
        for name in dirs:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None:
                    raise
                os.mkdir(name, create_mode, dir_fd=fd)
                if owner is not None:
                    os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:  # ELOOP (a symlink) or ENOTDIR (a file) on the path
                raise ArtifactError(f"{name!r} on the path is not a plain directory ({e.strerror})") from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _parent_dir(root: str, path: str, inside_prefix: str) -> tuple[int, str]:
    """An fd of `path`'s parent directory under `root`, reached without following any symlink, and the leaf name.
    The caller closes the fd."""
    parts = split_relpath(path, inside_prefix=inside_prefix)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        return _open_dir_chain(root_fd, parts[:-1]), parts[-1]
    except FileNotFoundError:
        raise FileNotFoundError(f"no artifact {path!r}") from None
    finally:
        os.close(root_fd)


def read_file(root: str, path: str, max_bytes: int, *, inside_prefix: str = "/work") -> bytes:
    """Read a regular file under `root` as data: no symlinks anywhere on the path, size-capped."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    dfd, leaf = _parent_dir(root, path, inside_prefix)
    try:
        try:
            fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                         | os.O_NOCTTY, dir_fd=dfd)
        except FileNotFoundError:
            raise FileNotFoundError(f"no artifact {path!r}") from None
        except OSError as e:
            raise ArtifactError(f"refusing artifact {path!r}: {e.strerror} (symlink or special file)") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"refusing artifact {path!r}: not a regular file")
        if st.st_size > max_bytes:
            raise ArtifactError(f"artifact {path!r} is {st.st_size} bytes, over the cap of {max_bytes}")
        chunks: list[bytes] = []
        total = 0
        while True:  # read at most max_bytes + 1 so a file that grows after fstat is still caught
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise ArtifactError(f"artifact {path!r} grew over the cap of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "char"), (stat.S_ISBLK, "block"))


def stat_path(root: str, path: str, *, inside_prefix: str = "/work") -> PathStat:
    """lstat an entry under `root`; parent directories must be plain directories (no symlinks)."""
    dfd, leaf = _parent_dir(root, path, inside_prefix)
    try:
        try:
            st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise FileNotFoundError(f"no artifact {path!r}") from None
    finally:
        os.close(dfd)
    kind = next(name for test, name in _KINDS if test(st.st_mode))
    return PathStat(kind=kind, mode=stat.S_IMODE(st.st_mode), size=st.st_size, uid=st.st_uid)


def write_file(root: str, path: str, data: bytes, mode: int = 0o644, *,
               owner: tuple[int, int] | None = None, inside_prefix: str = "/work") -> None:
    """Create/replace a regular file under `root`, creating parent dirs; never follows symlinks."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data for {path!r} must be bytes, got {type(data).__name__}")
    if not 0 <= mode <= 0o777:
        raise ValueError(f"mode {mode:#o} for {path!r}: only permission bits (no setuid/sticky) are allowed")
    parts = split_relpath(path, inside_prefix=inside_prefix)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        dfd = _open_dir_chain(root_fd, parts[:-1], create_mode=0o755, owner=owner)
    finally:
        os.close(root_fd)
    try:
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC | os.O_NOCTTY, mode, dir_fd=dfd)
        except OSError as e:
            raise ArtifactError(f"cannot write {path!r}: {e.strerror} (symlink or special file in the way?)") from None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactError(f"cannot write {path!r}: not a regular file")
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


MAX_WALK_DEPTH = 64  # directory levels below the root that a walk enters


def iter_regular_files(root: str, max_files: int) -> Iterator[tuple[str, int, int]]:
    """Yield (relative path, size, mode) of each regular file under `root`; symlinks are never followed.

    Directories more than `MAX_WALK_DEPTH` levels down are not entered (their files are not listed):
    os.fwalk recurses and holds one fd per level, so an agent's 3,000-level tree would otherwise raise
    RecursionError in the grader and pin a thousand fds of the host process while it walks.
    """
    count = 0
    # os.fwalk walks with directory fds and, with follow_symlinks=False, never enters a symlinked dir.
    for dirpath, dirnames, filenames, dfd in os.fwalk(root, follow_symlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir != "." and rel_dir.count("/") + 1 >= MAX_WALK_DEPTH:
            dirnames.clear()  # top-down walk: pruning here keeps fwalk from descending
        for name in sorted(filenames):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            count += 1
            if count > max_files:
                raise ArtifactError(f"more than {max_files} files in the work dir")
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            yield rel, st.st_size, st.st_mode


def list_files(root: str, max_files: int) -> list[str]:
    """Sorted relative paths of the regular files under `root`."""
    return sorted(rel for rel, _, _ in iter_regular_files(root, max_files))


def copy_tree_as_data(src_root: str, dst_root: str, *, max_files: int, max_total_bytes: int,
                      max_file_bytes: int) -> CopyReport:
    """Copy the regular files of an agent dir into a trusted dir as plain data.

    Symlinks, devices, FIFOs and sockets are skipped silently (they are not files); files get mode
    0644 (0755 if the owner could execute them) and belong to the caller. Caps never raise: a file
    over `max_file_bytes` is skipped, and copying stops at `max_files` / `max_total_bytes`, all
    recorded in the report. An agent that floods its work dir so gets an incomplete copy (its
    checks fail), not a grading error.
    """
    total = 0
    copied: list[str] = []
    skipped: list[tuple[str, str]] = []
    try:
        for rel, size, mode in iter_regular_files(src_root, max_files):
            if size > max_file_bytes:
                skipped.append((rel, f"{size} bytes > {max_file_bytes}"))
                continue
            if total + size > max_total_bytes:
                skipped.append((rel, f"total over {max_total_bytes} bytes"))
                continue
            try:
                data = read_file(src_root, rel, max_file_bytes)
            except (ArtifactError, FileNotFoundError) as e:
                skipped.append((rel, str(e)))
                continue
            total += len(data)
            write_file(dst_root, rel, data, 0o755 if mode & stat.S_IXUSR else 0o644)
            copied.append(rel)
    except ArtifactError as e:  # more than max_files
        skipped.append(("*", str(e)))
    return CopyReport(copied=tuple(copied), skipped=tuple(skipped))


def copy_agent_files(agent: object, dst: str, *, max_files: int, max_file_bytes: int) -> CopyReport | None:
    """Put an agent's files under `dst` as data, for a pristine grading sandbox (`open_pristine`).

    `agent` is any `Sandbox` (read through its interface: `list_artifacts` + `read_artifact`, so
    symlinks and special files are skipped and recorded), a mapping of relative path -> bytes, or
    None (nothing to copy). Backends with a faster host-side path (bwrap copies its work dir
    directly) call this for the other cases.
    """
    from envs.sandbox.base import Sandbox

    if isinstance(agent, Sandbox):
        copied, skipped = [], []
        try:
            rels = agent.list_artifacts(max_files=max_files)
        except ArtifactError as e:
            rels, skipped = [], [("*", str(e))]
        for rel in rels:
            try:
                write_file(dst, rel, agent.read_artifact(rel, max_bytes=max_file_bytes))
                copied.append(rel)
            except (ArtifactError, FileNotFoundError) as e:
                skipped.append((rel, str(e)))
        return CopyReport(copied=tuple(copied), skipped=tuple(skipped))
    if isinstance(agent, Mapping):
        for rel, data in agent.items():
            write_file(dst, rel, data)
        return None
    if agent is not None:
        raise TypeError(f"agent must be a Sandbox, a mapping of path -> bytes or None, got {type(agent).__name__}")
    return None
