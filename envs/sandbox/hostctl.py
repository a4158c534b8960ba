"""Host-side plumbing for the bwrap backend: slot uids, per-slot cgroups, tmpfs mounts, process sweeps.

* `SlotAllocator` hands out one unprivileged uid per live sandbox. Slots are `flock`ed lock files,
  so separate processes (Ray actors, pytest workers) sharing a machine never get the same uid, and
  a crashed owner's lock is released by the kernel; the next owner sweeps the stale slot first.
* `SlotCgroup` makes a pids + memory cgroup (v1 or v2) for a slot, nested under the cgroup this
  process is in, so the host's own accounting still covers the sandbox. When the hierarchy is not
  writable it reports why and the backend runs on rlimits alone (logged, never silent).
* `mount_tmpfs` / `unmount` wrap mount(2) via ctypes (size- and inode-limited work dirs).
* `pids_of_uid` / `kill_uid` sweep /proc: every process of a slot uid belongs to that slot.

What it does not do: no cgroup CPU shares (2-core machine, the trainer decides), no freezer.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000
MNT_DETACH = 0x2


def mount_tmpfs(path: Path, *, size_bytes: int, nr_inodes: int, mode: int = 0o755) -> None:
    """Mount a fresh tmpfs of `size_bytes` at `path` (needs CAP_SYS_ADMIN)."""
    opts = f"size={size_bytes},nr_inodes={nr_inodes},mode={mode:o}".encode()
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def bind_mount_ro(src: Path, dst: Path) -> None:
    """Bind `src` (recursively) on `dst`, then make the bind read-only, nosuid, nodev."""
    if _libc.mount(str(src).encode(), str(dst).encode(), None, MS_BIND | MS_REC, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind {src} on {dst}: {os.strerror(err)}")
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    if _libc.mount(None, str(dst).encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        unmount(dst)
        raise OSError(err, f"remount {dst} read-only: {os.strerror(err)}")


def unmount(path: Path) -> None:
    """Lazily detach the mount at `path` (no-op if nothing is mounted there)."""
    if not os.path.ismount(path):
        return
    if _libc.umount2(str(path).encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount {path}: {os.strerror(err)}")


def uids_with_processes() -> set[int]:
    """Real uids of all live processes (one /proc scan)."""
    out: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            uid = _live_uid(name)
            if uid is not None:
                out.add(uid)
    return out


def _live_uid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return None


def pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) host pids whose real uid is `uid`.

    Read from /proc/PID/status, not the owner of /proc/PID: non-dumpable tasks show root as owner.
    Zombies are skipped: they hold no resources and cannot be killed, only reaped by their parent.
    """
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and _live_uid(name) == uid]


def kill_uid(uid: int, *, timeout_s: float = 5.0) -> bool:
    """SIGKILL every process of `uid` until none is left; True if none is left within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = pids_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


@dataclass(frozen=True)
class Slot:
    """A leased sandbox identity: the uid/gid its processes run as, and the lock that holds it."""

    uid: int
    lock_fd: int


class SlotAllocator:
    """Leases uids `first_uid .. first_uid + n_slots - 1`, exclusive across processes (flock)."""

    def __init__(self, lock_dir: Path, first_uid: int, n_slots: int) -> None:
        if first_uid < 1000 or n_slots < 1:
            raise ValueError(f"slot uids must be >= 1000 and n_slots >= 1 (got {first_uid}, {n_slots})")
        self.lock_dir = lock_dir
        self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        taken = _uids_in_passwd()
        self.uids = [u for u in range(first_uid, first_uid + n_slots) if u not in taken]
        if not self.uids:
            raise ValueError(f"all uids {first_uid}..{first_uid + n_slots - 1} belong to /etc/passwd users")

    def try_acquire(self, uid: int) -> Slot | None:
        fd = os.open(self.lock_dir / f"slot-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return Slot(uid=uid, lock_fd=fd)

    def acquire(self, wait_s: float = 30.0) -> Slot:
        """A free slot, waiting up to `wait_s` for one. Slots are a scheduled resource: when many
        episodes end at once, their graders' pristine sandboxes briefly hold a second slot each, and a
        new episode should wait for those to close rather than fail."""
        deadline = time.monotonic() + wait_s
        while True:
            for uid in self.uids:
                slot = self.try_acquire(uid)
                if slot is not None:
                    return slot
            if time.monotonic() >= deadline:
                raise RuntimeError(f"all {len(self.uids)} sandbox slots stayed in use for {wait_s:g} s; "
                                   "close sandboxes or raise n_slots")
            time.sleep(0.02)

    @staticmethod
    def release(slot: Slot) -> None:
        try:
            fcntl.flock(slot.lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(slot.lock_fd)


def _uids_in_passwd() -> set[int]:
    uids: set[int] = set()
    try:
        with open("/etc/passwd") as f:
            for line in f:
                parts = line.split(":")
                if len(parts) > 2 and parts[2].isdigit():
                    uids.add(int(parts[2]))
    except OSError:
        pass
    return uids


# ---------------------------------------------------------------- cgroups

def _own_cgroup_paths() -> dict[str, str]:
    """controller name ('' for the v2 unified hierarchy) -> this process's cgroup path."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


class SlotCgroup:
    """A pids + memory cgroup for one slot. `ok` is False (with `why`) when cgroups are unusable."""

    def __init__(self, name: str, *, max_pids: int, memory_bytes: int, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.dirs: list[Path] = []
        self.ok = False
        self.why = ""
        try:
            own = _own_cgroup_paths()
            if (root / "cgroup.controllers").exists():  # pure v2
                base = root / own.get("", "/").lstrip("/")
                d = base / name
                self._fresh(d)
                self._write(d / "pids.max", str(max_pids))
                self._write(d / "memory.max", str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    self._write(d / "memory.swap.max", "0")
            else:
                for ctrl in ("pids", "memory"):
                    if not (root / ctrl).is_dir() or ctrl not in own:
                        raise OSError(errno.ENOENT, f"no v1 {ctrl} hierarchy mounted")
                    d = root / ctrl / own[ctrl].lstrip("/") / name
                    self._fresh(d)
                pids_d, mem_d = self.dirs
                self._write(pids_d / "pids.max", str(max_pids))
                self._write(mem_d / "memory.limit_in_bytes", str(memory_bytes))
                if (mem_d / "memory.memsw.limit_in_bytes").exists():
                    self._write(mem_d / "memory.memsw.limit_in_bytes", str(memory_bytes))
            self.ok = True
        except OSError as e:
            self.why = f"{e.strerror or e} ({e.filename or ''})"
            self.remove()

    @classmethod
    def remove_stale(cls, name: str, root: Path = Path("/sys/fs/cgroup")) -> bool:
        """Kill and remove a leftover cgroup `name` (any hierarchy); True if there was one."""
        try:
            own = _own_cgroup_paths()
        except OSError:
            return False
        found = False
        for ctrl, path in own.items():
            d = root / ctrl / path.lstrip("/") / name if ctrl else root / path.lstrip("/") / name
            if d.is_dir():
                found = True
                cls._kill_and_rmdir(d)
        return found

    def _fresh(self, d: Path) -> None:
        if d.exists():  # stale from a crashed owner of this slot
            self._kill_and_rmdir(d)
        d.mkdir()
        self.dirs.append(d)

    @staticmethod
    def _write(path: Path, value: str) -> None:
        with open(path, "w") as f:
            f.write(value)

    def attach(self, pid: int) -> None:
        for d in self.dirs:
            self._write(d / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
        return sorted(out)

    def kill(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @classmethod
    def _kill_and_rmdir(cls, d: Path, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                d.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("could not remove cgroup %s: %s", d, e)
                    return
                time.sleep(0.005)

    def remove(self) -> None:
        for d in self.dirs:
            self._kill_and_rmdir(d)
        self.dirs = []
