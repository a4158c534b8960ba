"""Trusted-side file access (envs/sandbox/safefs.py) on a plain temp dir the test plays 'agent' in."""
from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from envs.sandbox.safefs import ArtifactError, copy_tree_as_data, list_files, read_file, split_relpath, write_file


@pytest.fixture()
def dirs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    secret = tmp_path / "host_secret.txt"
    secret.write_text("TOP-SECRET")
    secret_dir = tmp_path / "host_dir"
    secret_dir.mkdir()
    (secret_dir / "key").write_text("KEY")
    return work, secret, secret_dir


def test_split_relpath():
    assert split_relpath("a/b.txt") == ["a", "b.txt"]
    assert split_relpath("./a//b") == ["a", "b"]
    assert split_relpath("/work/a/b") == ["a", "b"]
    for bad in ("", "..", "a/../b", "/etc/passwd", "/workx/a", "a\x00b", "/work", "."):
        with pytest.raises(ArtifactError):
            split_relpath(bad)


def test_read_regular_file_and_size_cap(dirs):
    work, _, _ = dirs
    (work / "sub").mkdir()
    (work / "sub" / "f.txt").write_bytes(b"x" * 100)
    assert read_file(str(work), "sub/f.txt", 100) == b"x" * 100
    assert read_file(str(work), "/work/sub/f.txt", 1000) == b"x" * 100
    with pytest.raises(ArtifactError, match="over the cap"):
        read_file(str(work), "sub/f.txt", 99)
    with pytest.raises(FileNotFoundError):
        read_file(str(work), "nope.txt", 10)


def test_symlinks_refused_anywhere_on_the_path(dirs):
    work, secret, secret_dir = dirs
    os.symlink(secret, work / "link")
    os.symlink(secret_dir, work / "dirlink")
    (work / "real").mkdir()
    os.symlink("../dirlink", work / "real" / "nested")
    for path in ("link", "dirlink/key", "real/nested/key"):
        with pytest.raises(ArtifactError):
            read_file(str(work), path, 1000)
    assert list_files(str(work), 100) == []  # symlinks are not listed, and not walked into


def test_special_files_refused_without_hanging(dirs):
    work, _, _ = dirs
    os.mkfifo(work / "fifo")  # opening a FIFO for reading would block forever without O_NONBLOCK
    os.mkdir(work / "adir")
    t0 = time.monotonic()
    for path in ("fifo", "adir"):
        with pytest.raises(ArtifactError):
            read_file(str(work), path, 1000)
    assert time.monotonic() - t0 < 1.0


def test_write_refuses_symlinked_parent_and_target(dirs):
    work, secret, secret_dir = dirs
    os.symlink(secret_dir, work / "out")
    os.symlink(secret, work / "target")
    with pytest.raises(ArtifactError):
        write_file(str(work), "out/key", b"PWNED")
    with pytest.raises(ArtifactError):
        write_file(str(work), "target", b"PWNED")
    assert (secret_dir / "key").read_text() == "KEY"
    assert secret.read_text() == "TOP-SECRET"


def test_write_creates_dirs_with_owner_and_mode(dirs):
    work, _, _ = dirs
    write_file(str(work), "a/b/c.sh", b"echo hi\n", 0o755, owner=(12345, 12346))
    st = os.stat(work / "a" / "b" / "c.sh")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (12345, 12346, 0o755)
    assert os.stat(work / "a").st_uid == 12345
    assert read_file(str(work), "a/b/c.sh", 100) == b"echo hi\n"
    with pytest.raises(ValueError):
        write_file(str(work), "x", b"", 0o4755)  # no setuid bits from trusted set-up either


def test_list_files_cap_and_order(dirs):
    work, _, _ = dirs
    for name in ("b", "a", "d/c"):
        write_file(str(work), name, b"1")
    assert list_files(str(work), 10) == ["a", "b", "d/c"]
    with pytest.raises(ArtifactError, match="more than 2 files"):
        list_files(str(work), 2)


def test_copy_tree_as_data_skips_links_and_specials(dirs, tmp_path):
    work, secret, _ = dirs
    write_file(str(work), "src/main.py", b"print(1)\n")
    write_file(str(work), "run.sh", b"#!/bin/sh\n", 0o700)
    os.symlink(secret, work / "src" / "evil")
    os.mkfifo(work / "pipe")
    dst = tmp_path / "dst"
    dst.mkdir()
    rep = copy_tree_as_data(str(work), str(dst), max_files=10, max_total_bytes=1000, max_file_bytes=100)
    assert sorted(rep.copied) == ["run.sh", "src/main.py"] and rep.skipped == ()
    assert sorted(os.listdir(dst)) == ["run.sh", "src"]
    assert os.listdir(dst / "src") == ["main.py"]
    assert stat.S_IMODE(os.stat(dst / "run.sh").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(dst / "src" / "main.py").st_mode) == 0o644


def test_copy_tree_caps_skip_instead_of_raising(dirs, tmp_path):
    work, _, _ = dirs
    write_file(str(work), "a", b"x" * 10)
    write_file(str(work), "b", b"x" * 200)
    write_file(str(work), "c", b"x" * 10)
    write_file(str(work), "d", b"x" * 10)
    dst = tmp_path / "dst"
    dst.mkdir()
    rep = copy_tree_as_data(str(work), str(dst), max_files=10, max_total_bytes=25, max_file_bytes=100)
    assert rep.copied == ("a", "c") and [p for p, _ in rep.skipped] == ["b", "d"]
    dst2 = tmp_path / "dst2"
    dst2.mkdir()
    rep2 = copy_tree_as_data(str(work), str(dst2), max_files=2, max_total_bytes=10_000, max_file_bytes=1000)
    assert rep2.copied == ("a", "b") and rep2.skipped[0][0] == "*"


def test_file_swapped_for_symlink_while_walking(dirs):
    """A racing agent that swaps a directory for a symlink mid-read only ever gets an error."""
    work, secret, secret_dir = dirs
    os.mkdir(work / "d")
    (work / "d" / "key").write_text("mine")
    stop = threading.Event()

    def swapper():
        while not stop.is_set():
            try:
                os.rename(work / "d", work / "d_real")
                os.symlink(secret_dir, work / "d")
                os.unlink(work / "d")
                os.rename(work / "d_real", work / "d")
            except OSError:
                pass

    t = threading.Thread(target=swapper)
    t.start()
    try:
        seen = set()
        for _ in range(500):
            try:
                seen.add(read_file(str(work), "d/key", 100))
            except (ArtifactError, FileNotFoundError):
                pass
    finally:
        stop.set()
        t.join()
    assert b"KEY" not in seen


def test_stat_path_reports_the_entry_itself(dirs):
    from envs.sandbox.safefs import stat_path

    work, secret, secret_dir = dirs
    write_file(str(work), "bin/run.sh", b"#!/bin/sh\n", 0o750)
    os.symlink(secret, work / "link")
    os.symlink(secret_dir, work / "dlink")
    os.mkfifo(work / "fifo")
    s = stat_path(str(work), "bin/run.sh")
    assert (s.kind, s.mode, s.size) == ("file", 0o750, 10)
    assert stat_path(str(work), "bin").kind == "dir"
    assert stat_path(str(work), "link").kind == "symlink"  # not the secret file it points to
    assert stat_path(str(work), "fifo").kind == "fifo"
    with pytest.raises(ArtifactError):
        stat_path(str(work), "dlink/key")  # no walking through a symlinked directory
    with pytest.raises(FileNotFoundError):
        stat_path(str(work), "missing")
