"""The bubblewrap sandbox backend: every agent command runs in fresh namespaces as an unprivileged uid.

What one sandbox (`BwrapBackend.open`) gives, and how:

* **Identity.** A slot uid (`hostctl.SlotAllocator`, e.g. 61000..61063) leased for the sandbox's
  lifetime, exclusive across processes. bwrap runs *as* that uid with a user namespace mapping it
  to itself, so the agent has no capabilities and files it creates on the host belong to it.
  RLIMIT_NPROC therefore counts the sandbox's processes only.
* **Filesystem.** A new root tmpfs, remounted read-only (docs/platform.md: without `--remount-ro /` it stays
  writable); the host's `/usr` read-only plus the `/bin`, `/lib*` links; a minimal `/etc` (a few
  files, a synthetic passwd/group/hosts); fresh `/proc` and `/dev` (its tmpfs read-only, a small
  `/dev/shm`); a private size-limited `/tmp`; and `/work`, a host directory on a size- and
  inode-limited tmpfs the host mounted for this slot. It persists across `run` calls until
  `close()`. The repo, `/root`, `/home` and the grader's files are simply never mounted. Extra
  read-only `Mount`s (a venv, a cache) only when asked. A caller that must not see all of `/usr`
  (the SWE domain: vendored copies of its libraries live in dist-packages) passes a `UsrView`: only
  its allowlisted subpaths are bound, and its `hide` paths are covered by empty read-only mounts.
* **No network.** Own net namespace (loopback only) and a seccomp filter refusing AF_INET/AF_INET6
  sockets; DNS fails because there is neither a resolver config nor an inet socket.
* **Seccomp** (`seccomp.py`): nested namespaces, ptrace, mount, bpf, io_uring, keyctl, inet sockets.
  bwrap sets no_new_privs before loading it.
* **Limits.** rlimits (NPROC, AS, FSIZE, CPU, NOFILE, CORE=0) set by util-linux `prlimit` (run as
  the slot uid, it lowers its own limits and execs bwrap), and a pids + memory cgroup per
  slot (`hostctl.SlotCgroup`; if cgroups are not writable the sandbox runs on rlimits alone and
  says so in the log and in `BwrapSandbox.cgroup_ok`).
* **Commands.** A small executor (`_server.py`) runs as pid 1 of the sandbox's pid namespace; each
  `run` hands it a command and three pipe ends, so a command costs a posix_spawn, not a bwrap
  start-up. After each command it SIGKILLs everything else in the namespace (setsid daemons, `&`
  jobs). The host drains stdout/stderr with a hard byte cap (head + tail kept, the middle dropped
  and flagged) and, at the wall-clock deadline, kills the namespace's pid 1 through a pidfd, which
  makes the kernel kill every process in it. The next `run` starts a fresh namespace (same /work).
* **Grading** (`open_pristine`): a fresh sandbox whose root is the host's read-only `/usr` (so an
  agent's replacement `python3`/`pytest` is never on PATH), the grader's files written by trusted
  code into `/work`, and the agent's regular files copied in as data (no symlinks, no devices,
  root-owned, read-only) at `/agent`. The agent's sandbox is killed first.

What it does not do: it is not a VM: a kernel exploit beats it. This backend needs root on the host (to
mount tmpfs, switch uids and write cgroups); without root, `BwrapBackend()` returns the rootless backend
(`rootless.py`: the same namespaces, seccomp and rlimits in a user namespace per sandbox, and it says which
root-only limits are absent), which refuses, saying what to change, where unprivileged user namespaces are
off. If the kernel refuses namespaces, `open()` raises `SandboxUnavailable`: we never run a command unsandboxed.
`network=True` is refused. Time limits are wall-clock per command plus RLIMIT_CPU per process;
there is no CPU share control. `/tmp` is scratch: it is lost when a timeout kills the namespace.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from envs.sandbox import hostctl, safefs
from envs.sandbox.base import (CopyReport, ExecResult, Mount, PathStat, Sandbox, SandboxBackend, SandboxLimits,
                                SandboxUnavailable)
from envs.sandbox.seccomp import compile_filter

log = logging.getLogger(__name__)

MiB = 1 << 20
_SERVER_SRC = (Path(__file__).with_name("_server.py")).read_text()
_READY = b"\x05\x00\x00\x00ready"  # the executor's first message (length-prefixed like every reply)
_RESERVED_INSIDE = ("/work", "/proc", "/dev", "/tmp", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64")


@dataclass(frozen=True)
class BwrapConfig:
    """Host-side settings of the backend (per machine, not per task)."""

    bwrap: str = "/usr/bin/bwrap"
    prlimit: str = "/usr/bin/prlimit"  # util-linux; applies the rlimits before bwrap starts
    state_dir: Path = Path("/run/jointrl-sandbox")  # slot locks and per-slot tmpfs mount points
    first_uid: int = 61000  # slot uids are first_uid .. first_uid + n_slots - 1 (skipping passwd users)
    # One uid per live sandbox. A terminal episode holds two while it is graded (its own and the
    # grader's pristine one), and a run keeps up to rollout.max_concurrent_episodes episodes live, so
    # the pool is sized well above twice that; unused uids cost nothing (a lock file when first leased).
    n_slots: int = 256
    python: str = "/usr/bin/python3"  # runs the in-sandbox executor; must be under the read-only /usr
    memory_mb: int | None = None  # cgroup memory per sandbox; None: address space + work + tmp + shm + 64
    shm_mb: int = 16
    use_cgroups: bool = True
    inodes_per_mb: int = 256  # nr_inodes of the work tmpfs per MiB (an empty-file flood is bounded)
    path_env: str = "/usr/local/bin:/usr/bin:/bin"
    lang: str = "C.UTF-8"
    start_timeout_s: float = 15.0
    etc_files: tuple[str, ...] = (
        "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf",
        "magic", "magic.mime", "mime.types", "protocols", "services", "os-release", "debian_version",
        "python3", "python3.11", "python3.12", "bash.bashrc", "inputrc", "timezone", "locale.alias",
    )


@dataclass(frozen=True)
class UsrView:
    """Which parts of the host's `/usr` a sandbox sees (the default, None, is all of it).

    allow: paths under /usr bound read-only at their own path (missing ones are skipped); they
        must include what the executor needs: `BwrapConfig.python`, its standard library and the
        shared libraries it loads.
    hide: paths under allowed ones covered by an empty read-only directory (or /dev/null for a
        file), e.g. a `site-packages` inside an allowed standard-library directory.
    """

    allow: tuple[str, ...]
    hide: tuple[str, ...] = ()

    def validated(self) -> "UsrView":
        def norm(p: str) -> str:
            q = os.path.normpath(p) if isinstance(p, str) else ""
            if not q.startswith("/usr/") or "/.." in q:
                raise ValueError(f"UsrView paths must be below /usr, got {p!r}")
            return q
        allow = tuple(sorted({norm(p) for p in self.allow}))
        hide = tuple(sorted({norm(p) for p in self.hide}))
        for h in hide:
            if not any(h.startswith(a + "/") for a in allow):
                raise ValueError(f"UsrView.hide {h!r} is not below an allowed path")
        return UsrView(allow=allow, hide=hide)


@dataclass
class _Capture:
    """Keeps the first and last `cap // 2` bytes of a stream; counts what it drops."""

    cap: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.cap // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            keep = self.cap - self.cap // 2
            # Trim lazily (amortised O(1) per byte); never trims while total <= cap, so short
            # outputs come back whole.
            if len(self.tail) > 2 * keep + (1 << 16):
                del self.tail[: len(self.tail) - keep]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def text(self) -> str:
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        keep = self.cap - self.cap // 2
        tail = bytes(self.tail[-keep:]) if keep else b""
        head = bytes(self.head[: self.cap // 2])
        dropped = self.total - len(head) - len(tail)
        return (head.decode("utf-8", "replace") + f"\n[... {dropped} bytes of output dropped ...]\n"
                + tail.decode("utf-8", "replace"))


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: bwrap must inherit it
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _validate_limits(limits: SandboxLimits) -> None:
    for name in ("workdir_mb", "tmp_mb", "max_procs", "address_space_mb", "file_size_mb", "cpu_seconds",
                 "open_files", "max_output_bytes"):
        v = getattr(limits, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"SandboxLimits.{name} must be a positive int, got {v!r}")
    if limits.max_procs < 4:
        raise ValueError(f"SandboxLimits.max_procs={limits.max_procs} is too small to run a shell (need >= 4)")
    if limits.open_files < 16:
        raise ValueError(f"SandboxLimits.open_files={limits.open_files} is too small (need >= 16)")


def _validate_mount(m: Mount) -> tuple[str, str]:
    inside = os.path.normpath(m.inside) if isinstance(m.inside, str) else ""
    if not inside.startswith("/") or inside == "/":
        raise ValueError(f"Mount.inside must be an absolute path below /, got {m.inside!r}")
    for r in _RESERVED_INSIDE:
        if inside == r or inside.startswith(r + "/"):
            raise ValueError(f"Mount.inside {m.inside!r} is under {r}, which the sandbox manages itself")
    host = Path(m.host)
    if not host.exists():
        raise ValueError(f"Mount.host {str(host)!r} does not exist")
    return str(host.resolve()), inside


def sandbox_report() -> str:
    """What sandbox this process would get, in one paragraph (`jointrl train --dry-run` prints it); raises
    SandboxUnavailable, saying what to change, where there would be none. Starts no sandbox as root; without
    root it runs one `bwrap ... true` to see whether user namespaces work."""
    if os.geteuid() == 0:
        cfg = BwrapConfig()
        if not os.access(cfg.bwrap, os.X_OK):
            raise SandboxUnavailable(f"bubblewrap not found at {cfg.bwrap} (apt-get install bubblewrap)")
        return "root: bubblewrap with a uid, a size-limited tmpfs /work and a memory/pids cgroup per sandbox"
    from envs.sandbox.rootless import ROOTLESS_LIMITS, USERNS_HELP, userns_problem

    problem = userns_problem()
    if problem:
        raise SandboxUnavailable(f"not root, and {problem}: the terminal, SWE and CAD domains cannot run; {USERNS_HELP}")
    return ROOTLESS_LIMITS


class BwrapBackend(SandboxBackend):
    """Opens `BwrapSandbox`es. Construct once per process; cheap to keep around. Constructed by a process that
    is not root, it is a `rootless.RootlessBwrapBackend`."""

    sandbox_cls: type = None  # BwrapSandbox (set below the class); the rootless backend opens its own kind

    def __new__(cls, *args, **kwargs):
        if cls is BwrapBackend and os.geteuid() != 0:
            from envs.sandbox.rootless import RootlessBwrapBackend

            return super().__new__(RootlessBwrapBackend)
        return super().__new__(cls)

    def __init__(self, config: BwrapConfig = BwrapConfig()) -> None:
        self.config = config
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "BwrapBackend needs root on the host (to mount per-sandbox tmpfs work dirs, run each "
                "sandbox as its own uid and write cgroups); refusing to run commands unsandboxed")
        if not os.access(config.bwrap, os.X_OK):
            raise SandboxUnavailable(f"bubblewrap not found at {config.bwrap} (apt-get install bubblewrap)")
        if not os.access(config.prlimit, os.X_OK):
            raise SandboxUnavailable(f"prlimit not found at {config.prlimit} (apt-get install util-linux)")
        if not os.path.realpath(config.python).startswith("/usr/") or not os.access(config.python, os.X_OK):
            raise SandboxUnavailable(f"{config.python} must be an executable python3 under /usr "
                                     "(it runs the in-sandbox executor from the read-only /usr)")
        self._seccomp = compile_filter()
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.config.state_dir, 0o711)  # slot uids walk through to their work dir, never list it
        self._slots = hostctl.SlotAllocator(config.state_dir / "locks", config.first_uid, config.n_slots)
        self._open_boxes: "weakref.WeakSet[BwrapSandbox]" = weakref.WeakSet()
        self._warned_cgroup = False
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bwrap-spawner")
        self.sweep_stale()
        atexit.register(self._close_all)

    # ------------------------------------------------------------------ public API

    def open(self, *, limits: SandboxLimits = SandboxLimits(), files: Mapping[str, bytes] | None = None,
             mounts: tuple[Mount, ...] = (), network: bool = False, usr: UsrView | None = None) -> "BwrapSandbox":
        """`SandboxBackend.open`; `usr` (bubblewrap only) narrows the read-only `/usr` to an allowlist."""
        if network:
            raise SandboxUnavailable("BwrapBackend has no network mode: sandboxes get their own empty net namespace")
        return self._open(limits=limits, files=files, mounts=mounts, usr=usr)

    def open_pristine(self, *, agent: Sandbox | Mapping[str, bytes] | None, files: Mapping[str, bytes] | None = None,
                      limits: SandboxLimits = SandboxLimits(), mounts: tuple[Mount, ...] = (),
                      agent_dir: str = "/agent", max_agent_files: int = 10_000,
                      max_agent_file_bytes: int = 32 * MiB, usr: UsrView | None = None) -> "BwrapSandbox":
        """`SandboxBackend.open_pristine` (see its contract in base.py), the bubblewrap way.

        The root is the host's read-only `/usr` (PATH `/usr/local/bin:/usr/bin:/bin`), `files` go
        into `/work` owned by the new sandbox's uid, and the agent's files are copied into a
        host-root-owned directory bound read-only at `agent_dir`. From another `BwrapSandbox` the
        copy walks its host-side work dir directly (`safefs.copy_tree_as_data`); from any other
        `Sandbox` it goes through `list_artifacts` / `read_artifact`.
        """
        if isinstance(agent, Sandbox):
            agent.kill_all()
        size_mb = limits.workdir_mb
        if isinstance(agent, BwrapSandbox):
            size_mb += agent.limits.workdir_mb
        elif isinstance(agent, Mapping):
            size_mb += sum(len(v) for v in agent.values()) // MiB + 1
        elif isinstance(agent, Sandbox):
            size_mb += 64
        agent_inside = _validate_mount(Mount(host=Path("/"), inside=agent_dir))[1]

        def populate(box: BwrapSandbox) -> None:
            dst = box.slot_dir / "agent"
            dst.mkdir(mode=0o755)
            if isinstance(agent, BwrapSandbox):
                box.agent_copy = safefs.copy_tree_as_data(
                    str(agent.workdir_host), str(dst), max_files=max_agent_files,
                    max_total_bytes=agent.limits.workdir_mb * MiB, max_file_bytes=max_agent_file_bytes)
            else:
                report = safefs.copy_agent_files(agent, str(dst), max_files=max_agent_files, max_file_bytes=max_agent_file_bytes)
                if report is not None:
                    box.agent_copy = report

        return self._open(limits=replace(limits, workdir_mb=size_mb), files=files, mounts=mounts,
                          populate=populate, agent_inside=agent_inside, pristine=True, usr=usr)

    # ------------------------------------------------------------------ internals

    def _open(self, *, limits: SandboxLimits, files: Mapping[str, bytes] | None, mounts: tuple[Mount, ...],
              populate=None, agent_inside: str | None = None, pristine: bool = False,
              usr: UsrView | None = None) -> "BwrapSandbox":
        _validate_limits(limits)
        binds = [_validate_mount(m) for m in mounts]
        usr = usr.validated() if usr is not None else None
        slot = self._slots.acquire()
        box: BwrapSandbox | None = None
        try:
            box = self.sandbox_cls(self, slot, limits, binds, agent_inside=agent_inside, pristine=pristine, usr=usr)
            if populate is not None:
                populate(box)
            for rel, data in (files or {}).items():
                box.write_file(rel, data)
            box._start()
        except BaseException:
            if box is not None:
                box.close()
            else:
                self._slots.release(slot)
            raise
        self._open_boxes.add(box)
        return box

    def _spawn(self, args: list[str], **popen_kw) -> subprocess.Popen:
        """Popen from one long-lived thread: bwrap's --die-with-parent (PR_SET_PDEATHSIG) fires when
        the *thread* that forked it exits, so a sandbox opened from a short-lived worker thread
        would otherwise die with that thread."""
        return self._spawner.submit(subprocess.Popen, args, **popen_kw).result()

    def _sweep_slot(self, uid: int, *, has_procs: bool | None = None) -> bool:
        """Kill processes, unmount the work dir and remove the cgroup of a slot whose lock we hold."""
        slot_dir = self.config.state_dir / f"slot-{uid}"
        had = bool(hostctl.pids_of_uid(uid)) if has_procs is None else has_procs
        if had:
            hostctl.kill_uid(uid)
        if os.path.ismount(slot_dir):
            had = True
            hostctl.unmount(slot_dir)
        return hostctl.SlotCgroup.remove_stale(f"jointrl-slot-{uid}") or had

    def sweep_stale(self) -> list[int]:
        """Clean every slot no live process holds (a crashed owner's mounts, cgroups, processes).

        Returns the uids that had leftovers. `open()` sweeps the slot it takes anyway; the
        constructor calls this so leftovers do not sit in memory until their slot comes round again.
        """
        with_procs = hostctl.uids_with_processes()
        cleaned = []
        for uid in self._slots.uids:
            slot = self._slots.try_acquire(uid)
            if slot is None:
                continue
            try:
                if self._sweep_slot(uid, has_procs=uid in with_procs):
                    cleaned.append(uid)
            finally:
                self._slots.release(slot)
        if cleaned:
            log.warning("swept leftovers of crashed sandboxes for slot uids %s", cleaned)
        return cleaned

    def _close_all(self) -> None:
        for box in list(self._open_boxes):
            try:
                box.close()
            except Exception:  # at interpreter exit: best effort, keep closing the others
                log.exception("closing sandbox slot %s at exit", box.uid)


class BwrapSandbox(Sandbox):
    """One episode's sandbox. Thread-safe: `run` calls are serialised; `close` may come from any thread."""

    def __init__(self, backend: BwrapBackend, slot: hostctl.Slot, limits: SandboxLimits,
                 binds: list[tuple[str, str]], *, agent_inside: str | None, pristine: bool,
                 usr: UsrView | None = None) -> None:
        self._set_state(backend, slot, limits, binds, agent_inside=agent_inside, pristine=pristine, usr=usr)

        backend._sweep_slot(self.uid)  # whatever a crashed previous owner of this uid left behind
        self.slot_dir = self.config.state_dir / f"slot-{self.uid}"
        self.slot_dir.mkdir(mode=0o711, exist_ok=True)
        size = limits.workdir_mb * MiB
        # bwrap (running as the slot uid) resolves bind sources by path, so they must be traversable
        # by it: 0711 lets it walk in without listing anything.
        hostctl.mount_tmpfs(self.slot_dir, size_bytes=size,
                            nr_inodes=max(1024, limits.workdir_mb * self.config.inodes_per_mb), mode=0o711)
        self.workdir_host = self.slot_dir / "work"
        self.workdir_host.mkdir(mode=0o700)
        os.chown(self.workdir_host, self.uid, self.uid)
        # Extra mounts are staged as read-only bind mounts under the slot dir, so a host path the
        # slot uid cannot reach (a venv under /root) can still be offered; unmounting the slot
        # tmpfs (MNT_DETACH) takes them along.
        for i, (host, _) in enumerate(binds):
            stage = self.slot_dir / "mnt" / str(i)
            if os.path.isdir(host):
                stage.mkdir(parents=True, mode=0o711)
            else:
                stage.parent.mkdir(parents=True, mode=0o711, exist_ok=True)
                stage.touch(mode=0o444)
            hostctl.bind_mount_ro(Path(host), stage)

        self.cgroup: hostctl.SlotCgroup | None = None
        if self.config.use_cgroups:
            mem_mb = self.config.memory_mb or (limits.address_space_mb + limits.workdir_mb + limits.tmp_mb
                                               + self.config.shm_mb + 64)
            cg = hostctl.SlotCgroup(f"jointrl-slot-{self.uid}", max_pids=limits.max_procs + 2,
                                    memory_bytes=mem_mb * MiB)
            if cg.ok:
                self.cgroup = cg
            elif not backend._warned_cgroup:
                backend._warned_cgroup = True
                log.warning("cgroups not usable (%s): sandboxes are limited by rlimits only", cg.why)

    def _set_state(self, backend: BwrapBackend, slot: hostctl.Slot, limits: SandboxLimits,
                   binds: list[tuple[str, str]], *, agent_inside: str | None, pristine: bool,
                   usr: UsrView | None) -> None:
        """The sandbox's own fields (no host work): shared with the rootless sandbox, whose set-up differs."""
        self.backend = backend
        self.config = backend.config
        self.limits = limits
        self.uid = slot.uid  # rootless: the uid inside the namespace (a slot number, not a host identity)
        self.pristine = pristine
        self._slot = slot
        self._binds = binds
        self._usr = usr
        self._agent_inside = agent_inside
        self._lock = threading.Lock()
        self._sig_lock = threading.Lock()
        self._closed = False
        self._proc: subprocess.Popen | None = None
        self._pidfd: int | None = None
        self._ctl: socket.socket | None = None
        self.restarts = 0  # namespaces started after the first (timeouts, killed executor)
        self.agent_copy: CopyReport | None = None  # pristine sandboxes: what was copied to /agent

    @property
    def cgroup_ok(self) -> bool:
        return self.cgroup is not None

    # ------------------------------------------------------------------ namespace lifecycle

    def _prlimit_args(self) -> list[str]:
        lim = self.limits
        want = {"nproc": (resource.RLIMIT_NPROC, lim.max_procs + 2),  # + bwrap and the executor
                "as": (resource.RLIMIT_AS, lim.address_space_mb * MiB),
                "fsize": (resource.RLIMIT_FSIZE, lim.file_size_mb * MiB),
                "cpu": (resource.RLIMIT_CPU, lim.cpu_seconds),
                "nofile": (resource.RLIMIT_NOFILE, lim.open_files),
                "core": (resource.RLIMIT_CORE, 0)}
        args = [self.config.prlimit]
        for name, (res, value) in want.items():
            hard = resource.getrlimit(res)[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)  # an unprivileged process can only lower its hard limits
            # CPU: the hard limit one second above the soft one, so the process first gets SIGXCPU
            # (reported as exit -24, distinguishable from a wall-clock kill) and SIGKILL after.
            hard_value = value + 1 if res == resource.RLIMIT_CPU else value
            if hard != resource.RLIM_INFINITY:
                hard_value = min(hard_value, hard)
            args.append(f"--{name}={value}:{hard_value}")
        return args + ["--"]

    def _bwrap_args(self, fds: Mapping[str, int]) -> list[str]:
        cfg, lim = self.config, self.limits
        a = [cfg.bwrap, "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-net", "--unshare-ipc",
             "--unshare-uts", "--unshare-cgroup-try", "--uid", str(self.uid), "--gid", str(self.uid),
             "--hostname", "sandbox"] + self._usr_args()
        for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
            if os.path.islink(top):
                a += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                a += ["--ro-bind", top, top]
        a += ["--dir", "/etc"]
        for name in cfg.etc_files:
            a += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        a += ["--ro-bind-data", str(fds["passwd"]), "/etc/passwd",
              "--ro-bind-data", str(fds["group"]), "/etc/group",
              "--ro-bind-data", str(fds["hosts"]), "/etc/hosts",
              "--proc", "/proc", "--dev", "/dev",
              "--perms", "1777", "--size", str(cfg.shm_mb * MiB), "--tmpfs", "/dev/shm",
              "--remount-ro", "/dev",  # the /dev tmpfs itself would otherwise be an unlimited writable dir
              "--perms", "1777", "--size", str(lim.tmp_mb * MiB), "--tmpfs", "/tmp",
              "--bind", str(self.workdir_host), "/work"]
        if self._agent_inside is not None:
            a += ["--ro-bind", str(self.slot_dir / "agent"), self._agent_inside]
        for i, (_, inside) in enumerate(self._binds):
            a += ["--ro-bind", str(self.slot_dir / "mnt" / str(i)), inside]
        a += ["--ro-bind-data", str(fds["server"]), "/.executor.py",
              "--remount-ro", "/", "--clearenv", "--chdir", "/work", "--new-session", "--die-with-parent",
              "--as-pid-1", "--seccomp", str(fds["seccomp"]), "--info-fd", str(fds["info"]),
              "--block-fd", str(fds["block"]),
              "--", cfg.python, "-I", "-S", "/.executor.py", str(fds["ctl"])]
        return a

    def _usr_args(self) -> list[str]:
        if self._usr is None:
            return ["--ro-bind", "/usr", "/usr"]
        a = ["--perms", "0755", "--dir", "/usr"]
        made = {"/usr"}
        for p in self._usr.allow:
            if not os.path.lexists(p):
                continue
            parent = os.path.dirname(p)
            chain = []
            while parent not in made:  # parents bwrap would otherwise create 0700
                chain.append(parent)
                parent = os.path.dirname(parent)
            for d in reversed(chain):
                a += ["--perms", "0755", "--dir", d]
                made.add(d)
            a += ["--ro-bind", p, p]
            made.add(p)
        for h in self._usr.hide:
            if os.path.isdir(h) and not os.path.islink(h):
                a += ["--perms", "0555", "--size", "4096", "--tmpfs", h, "--remount-ro", h]
            elif os.path.lexists(h):
                a += ["--ro-bind", "/dev/null", h]
        return a

    def _start(self) -> None:
        """Start a fresh namespace with the executor as its pid 1; raise SandboxUnavailable if bwrap fails."""
        if self._closed:
            raise RuntimeError(f"sandbox slot {self.uid} is closed")
        ctl_host, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        name = "agent" if not self.pristine else "grader"
        fds = {
            "seccomp": _memfd("seccomp", self.backend._seccomp),
            "passwd": _memfd("passwd", f"root:x:0:0:root:/:/usr/sbin/nologin\n{name}:x:{self.uid}:{self.uid}::/work:/bin/bash\n"
                             f"nobody:x:65534:65534::/:/usr/sbin/nologin\n".encode()),
            "group": _memfd("group", f"root:x:0:\n{name}:x:{self.uid}:\nnogroup:x:65534:\n".encode()),
            "hosts": _memfd("hosts", b"127.0.0.1 localhost sandbox\n::1 localhost\n"),
            "server": _memfd("executor", _SERVER_SRC.encode()),
            "info": info_w, "block": block_r,
        }
        fds["ctl"] = ctl_child.fileno()  # last: closed through its socket object
        child_ends = list(fds.values())
        errfile = tempfile.TemporaryFile()
        try:
            # rlimits: this host may lack CAP_SYS_RESOURCE (then prlimit(2) on another uid's process
            # is refused), so util-linux `prlimit` lowers its own limits as the slot uid and execs bwrap.
            proc = self.backend._spawn(
                self._prlimit_args() + self._bwrap_args(fds), user=self.uid, group=self.uid, extra_groups=[],
                pass_fds=child_ends, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=errfile, start_new_session=True, env={})
        except BaseException:
            for fd in child_ends[:-1]:
                os.close(fd)
            for fd in (info_r, block_w):
                os.close(fd)
            ctl_child.close()
            ctl_host.close()
            errfile.close()
            raise
        for fd in child_ends[:-1]:
            os.close(fd)
        ctl_child.close()
        try:
            info = self._read_info(info_r, proc)
            if info is not None:
                child = int(info["child-pid"])
                pidfd = os.pidfd_open(child)
                if self.cgroup is not None:
                    self.cgroup.attach(child)
                try:
                    os.write(block_w, b"go")  # only now may the executor exec: it is in the cgroup
                except BrokenPipeError:
                    pass  # bwrap failed while setting up mounts: reported below
            if info is None or not self._wait_ready(ctl_host, proc):
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                errfile.seek(0)
                msg = errfile.read(4000).decode("utf-8", "replace").strip()
                raise SandboxUnavailable(f"bubblewrap could not start the sandbox (exit {proc.returncode}): "
                                         f"{msg or 'no message'}; refusing to run unsandboxed")
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            ctl_host.close()
            if "pidfd" in locals():
                os.close(pidfd)
            raise
        finally:
            os.close(info_r)
            os.close(block_w)
            errfile.close()
        self._proc, self._pidfd, self._ctl = proc, pidfd, ctl_host

    def _wait_ready(self, ctl: socket.socket, proc: subprocess.Popen) -> bool:
        """The executor says hello once it runs; EOF or silence means bwrap or python failed."""
        ctl.settimeout(self.config.start_timeout_s)
        try:
            buf = b""
            while len(buf) < len(_READY):
                chunk = ctl.recv(len(_READY) - len(buf))
                if not chunk:
                    return False
                buf += chunk
            return buf == _READY
        except (socket.timeout, OSError):
            return False
        finally:
            ctl.settimeout(None)

    def _read_info(self, info_r: int, proc: subprocess.Popen) -> dict | None:
        deadline = time.monotonic() + self.config.start_timeout_s
        buf = b""
        sel = selectors.DefaultSelector()
        sel.register(info_r, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                if not sel.select(timeout=0.05):
                    if proc.poll() is not None:
                        return None
                    continue
                chunk = os.read(info_r, 4096)
                if not chunk:
                    return None
                buf += chunk
                try:
                    return json.loads(buf)
                except ValueError:
                    continue
            return None
        finally:
            sel.close()

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _signal_pid1(self) -> None:
        with self._sig_lock:  # the pidfd may be closed by the thread running a command
            if self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _kill_namespace(self) -> None:
        """SIGKILL pid 1 of the namespace (the kernel then kills every process in it) and reap bwrap.

        pid 1 is killed first and bwrap left to reap it: killing bwrap first would orphan pid 1 to
        the host's init, and unreaped zombies still count against the slot uid's RLIMIT_NPROC.
        """
        self._signal_pid1()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log.error("bwrap for slot %s did not exit after SIGKILL", self.uid)
            self._proc = None
        with self._sig_lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None

    # ------------------------------------------------------------------ Sandbox API

    def run(self, command: str | list[str], *, timeout_s: float, stdin: bytes | None = None,
            env: Mapping[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        if isinstance(command, str):
            argv = ["/bin/bash", "-c", command]
        elif isinstance(command, (list, tuple)) and command and all(isinstance(x, str) for x in command):
            argv = list(command)
        else:
            raise TypeError(f"command must be a str or a non-empty list of str, got {command!r:.200}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if any("\x00" in x for x in argv) or (cwd is not None and "\x00" in cwd):
            raise ValueError("command or cwd contains a NUL byte")
        full_env = {"PATH": self.config.path_env, "HOME": self.workdir_inside, "LANG": self.config.lang}
        for k, v in (env or {}).items():
            if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\x00" in k + v:
                raise ValueError(f"bad environment entry {k!r}={v!r:.100}")
            full_env[k] = v
        wd = cwd or self.workdir_inside
        if not wd.startswith("/"):
            wd = f"{self.workdir_inside}/{wd}"
        # The executor's wire format: NUL-separated cwd, argc, argv..., KEY=value... (no NULs inside).
        body = "\0".join([wd, str(len(argv)), *argv, *(f"{k}={v}" for k, v in full_env.items())]).encode(
            "utf-8", "surrogateescape")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"sandbox slot {self.uid} is closed")
            if not self._alive():
                self._kill_namespace()
                self.restarts += 1
                self._start()
            return self._run_locked(body, timeout_s, stdin)

    def _run_locked(self, body: bytes, timeout_s: float, stdin: bytes | None) -> ExecResult:
        assert self._ctl is not None
        t0 = time.monotonic()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            msg = struct.pack("<I", len(body)) + body
            sent = socket.send_fds(self._ctl, [msg], [in_r, out_w, err_w])
            self._ctl.sendall(msg[sent:])
            server_ok = True
        except OSError:
            server_ok = False  # the executor died between calls; report it as a killed command
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        caps = {out_r: _Capture(self.limits.max_output_bytes), err_r: _Capture(self.limits.max_output_bytes)}
        pending = memoryview(stdin or b"")
        sel = selectors.DefaultSelector()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE)
        else:
            os.close(in_w)
            in_w = -1
        ctl_fd = self._ctl.fileno()
        if server_ok:
            sel.register(ctl_fd, selectors.EVENT_READ)
        status = b""
        rc: int | None = None
        timed_out = False
        killed = not server_ok
        deadline = t0 + timeout_s
        drain_deadline: float | None = None  # after a kill, how long to wait for the pipes to close
        open_fds = {out_r, err_r}
        try:
            if killed:
                self._kill_namespace()
                drain_deadline = time.monotonic() + 2.0
            while open_fds or (rc is None and not killed):
                now = time.monotonic()
                if not killed and now >= deadline:
                    timed_out = killed = True
                    self._kill_namespace()
                    if ctl_fd in sel.get_map():
                        sel.unregister(ctl_fd)
                    drain_deadline = time.monotonic() + 2.0
                if drain_deadline is not None and now >= drain_deadline:
                    break
                wait = (drain_deadline if drain_deadline is not None else deadline) - now
                for key, _ in sel.select(timeout=max(0.0, min(wait, 1.0))):
                    fd = key.fd
                    if fd == in_w:
                        try:
                            n = os.write(in_w, pending[:1 << 16])
                            pending = pending[n:]
                        except (BrokenPipeError, BlockingIOError) as e:
                            if isinstance(e, BrokenPipeError):
                                pending = pending[:0]
                        if not pending:
                            sel.unregister(in_w)
                            os.close(in_w)
                            in_w = -1
                    elif fd == ctl_fd:
                        try:
                            chunk = self._ctl.recv(4096)
                        except OSError:
                            chunk = b""
                        if not chunk:  # the executor died (OOM-killed, ...): the namespace is gone
                            sel.unregister(ctl_fd)
                            killed = True
                            self._kill_namespace()
                            drain_deadline = time.monotonic() + 2.0
                            continue
                        status += chunk
                        if len(status) >= 4 and len(status) >= 4 + struct.unpack("<I", status[:4])[0]:
                            n = struct.unpack("<I", status[:4])[0]
                            rc = int(status[4:4 + n])
                            sel.unregister(ctl_fd)
                    else:
                        try:
                            chunk = os.read(fd, 1 << 16)
                        except BlockingIOError:
                            continue
                        if chunk:
                            caps[fd].add(chunk)
                        else:
                            sel.unregister(fd)
                            open_fds.discard(fd)
        finally:
            sel.close()
            for fd in (out_r, err_r) + ((in_w,) if in_w >= 0 else ()):
                os.close(fd)
        if rc is None:
            rc = -signal.SIGKILL
        out, err = caps[out_r], caps[err_r]
        return ExecResult(stdout=out.text(), stderr=err.text(), exit_code=rc, timed_out=timed_out,
                          output_truncated=out.truncated or err.truncated, duration_s=time.monotonic() - t0)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        if self._closed:
            raise RuntimeError(f"sandbox slot {self.uid} is closed")
        safefs.write_file(str(self.workdir_host), path, data, mode, owner=(self.uid, self.uid))

    def read_artifact(self, path: str, max_bytes: int = 1_000_000) -> bytes:
        if self._closed:
            raise RuntimeError(f"sandbox slot {self.uid} is closed")
        return safefs.read_file(str(self.workdir_host), path, max_bytes)

    def stat_artifact(self, path: str) -> PathStat:
        """`Sandbox.stat_artifact`: an lstat of the entry under the host-side work dir (`safefs.stat_path`)."""
        if self._closed:
            raise RuntimeError(f"sandbox slot {self.uid} is closed")
        return safefs.stat_path(str(self.workdir_host), path)

    def list_artifacts(self, max_files: int = 10_000) -> list[str]:
        if self._closed:
            raise RuntimeError(f"sandbox slot {self.uid} is closed")
        return safefs.list_files(str(self.workdir_host), max_files)

    def kill_all(self) -> None:
        """Kill the namespace, then sweep the cgroup and every process of the slot uid until none is left."""
        self._kill_namespace_unlocked()
        if self.cgroup is not None:
            self.cgroup.kill()
        if not hostctl.kill_uid(self.uid):
            log.error("processes of sandbox uid %s survived SIGKILL for 5 s", self.uid)

    def _kill_namespace_unlocked(self) -> None:
        # A running `run` holds the lock: killing pid 1 first makes it return promptly, then the
        # clean-up happens under the lock.
        self._signal_pid1()
        with self._lock:
            self._kill_namespace()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.kill_all()
        finally:
            try:
                hostctl.unmount(self.slot_dir)  # first: its pages are charged to the memory cgroup
                try:
                    self.slot_dir.rmdir()
                except OSError:
                    pass
                if self.cgroup is not None:
                    self.cgroup.remove()
            finally:
                self.backend._slots.release(self._slot)
                self.backend._open_boxes.discard(self)

    def __enter__(self) -> "BwrapSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BwrapSandbox(uid={self.uid}, pristine={self.pristine}, closed={self._closed})"


BwrapBackend.sandbox_cls = BwrapSandbox
