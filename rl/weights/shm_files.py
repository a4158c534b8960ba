"""The files of the shared-memory sync area: their names, the sweep of stale ones, and the reaper.

Files are named `jointrl-sync-<pid>-<process start time>-<token>-<slot>`: a file whose owner pid is
dead, or alive with another start time (pid reuse), is stale and removed when the next area starts
(`sweep_stale_shm`). Against an owner killed without running Python cleanup (`ray.kill` exits at
once, no atexit), each area starts a tiny reaper process that blocks on a pipe only the owner
holds; when the owner dies, the pipe closes and the reaper unlinks the files (mappings already held
by workers stay valid). `close_area` is the normal cleanup (close, finalizer).

What this module does not do: create, map, lock or write the files (shm.py).
"""
from __future__ import annotations

import os
import subprocess

from rl.log import get_logger

log = get_logger("weights")

SHM_DIR = "/dev/shm"
SHM_PREFIX = "jointrl-sync-"


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may contain spaces and ')': fields after the last ')' start at field 3
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _parse_shm_name(name: str) -> tuple[int, int] | None:
    """(pid, start time) of an area file name `jointrl-sync-<pid>-<start>-<token>-<slot>`, None if not ours."""
    if not name.startswith(SHM_PREFIX):
        return None
    parts = name[len(SHM_PREFIX):].split("-")
    if len(parts) != 4 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def sweep_stale_shm(directory: str = SHM_DIR) -> list[str]:
    """Remove area files whose owner process is gone (dead pid, or a reused pid with another start time)."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        owner = _parse_shm_name(name)
        if owner is None or proc_start_time(owner[0]) == owner[1]:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:  # another sweeper got it
            pass
    if removed:
        log.info("removed %d stale weight-sync files in %s: %s", len(removed), directory, removed)
    return removed


# The reaper: blocks on its stdin (a pipe only the owner holds) and, at EOF (owner exited or died),
# removes the owner's files. It is a grandchild in its own session: Ray kills an exiting worker's
# direct children (RAY_kill_child_processes_on_worker_exit, on by default), not its grandchildren,
# and a signal to the owner's process group does not reach another session. A launcher (the
# direct child) starts it and exits.
# Both snippets import only the standard library: they work whatever the package layout and sys.path.
REAPER = ("import os,sys\n"
          "sys.stdin.buffer.read()\n"
          "d,p=sys.argv[1],sys.argv[2]\n"
          "for n in os.listdir(d):\n"
          "    if n.startswith(p):\n"
          "        try: os.unlink(os.path.join(d,n))\n"
          "        except FileNotFoundError: pass\n")
LAUNCHER = ("import subprocess,sys\n"
            "subprocess.Popen([sys.executable,'-c',sys.argv[1]]+sys.argv[2:],stdin=0,stdout=subprocess.DEVNULL,"
            "start_new_session=True,close_fds=True)\n")


def close_area(paths: list[str], reaper: "subprocess.Popen | None") -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    if reaper is not None and reaper.stdin is not None:
        try:
            reaper.stdin.close()
            reaper.wait(timeout=10)
        except Exception:  # noqa: BLE001 - interpreter shutdown; the reaper exits at EOF anyway
            pass
