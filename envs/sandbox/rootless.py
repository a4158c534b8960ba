"""The bubblewrap sandbox without root: the same namespaces, seccomp filter and rlimits, from an unprivileged user.

Where the kernel lets unprivileged users create user namespaces (`kernel.unprivileged_userns_clone`,
`user.max_user_namespaces`, and no AppArmor restriction), bubblewrap runs every sandbox in its own user, pid,
net, ipc, uts and mount namespaces exactly as the root backend does (`bwrap.py`), with the same read-only
root, `/usr`, `/etc`, `/proc`, `/dev`, private `/tmp`, the same seccomp filter (no inet sockets, no nested
namespaces, no ptrace, mount, bpf, io_uring, keyctl), the same executor as pid 1, wall-clock kills of the whole
namespace, output caps, and the grading sandbox with the agent's files copied in as read-only data.

What needs root, and what stands in for it here (`ROOTLESS_LIMITS`, said once in the log and by
`sandbox_report()`):

* a uid per sandbox -> a user namespace per sandbox: inside, the agent is an unprivileged uid with no
  capabilities on the host; all sandboxes map to the run's own host uid, and each sees only its own `/work`
  (mount namespace) and its own processes (pid namespace), so they cannot reach each other or the run;
* RLIMIT_NPROC set by `prlimit` as the slot uid -> set by the executor inside the sandbox's user namespace,
  where the kernel (5.14+, per-namespace ucounts) counts only that namespace's processes;
* a pids + memory cgroup per sandbox -> absent unless the user has a delegated cgroup (then used as with root):
  memory is bounded per process by RLIMIT_AS, and in all by RLIMIT_AS x the process limit;
* a size- and inode-limited tmpfs for `/work` (mounting one needs root) -> a plain directory in the user's
  state dir: each file is bounded by RLIMIT_FSIZE, the directory's total size and file count are not.

Without root and without unprivileged user namespaces, `RootlessBwrapBackend()` raises `SandboxUnavailable`
saying what to change; nothing ever runs unsandboxed.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from envs.sandbox import hostctl
from envs.sandbox.base import SandboxUnavailable
from envs.sandbox.bwrap import BwrapBackend, BwrapConfig, BwrapSandbox
from envs.sandbox.seccomp import compile_filter

log = logging.getLogger(__name__)

ROOTLESS_LIMITS = (
    "rootless sandbox (no root: unprivileged user namespaces): each sandbox has its own user, pid, net, ipc, uts "
    "and mount namespaces, the seccomp filter and the rlimits (AS, FSIZE, CPU, NOFILE, CORE, and NPROC counted "
    "inside its user namespace); absent without root: a host uid per sandbox (all map to this user), the "
    "memory/pids cgroup (memory is bounded per process by RLIMIT_AS), and the /work size and inode limits "
    "(each file is bounded by RLIMIT_FSIZE)")

USERNS_HELP = ("run as root, or allow unprivileged user namespaces: `sysctl -w kernel.unprivileged_userns_clone=1` "
               "(Debian/Ubuntu kernels), `sysctl -w user.max_user_namespaces=15000` (if it is 0), and on Ubuntu 23.10+ "
               "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (or an AppArmor profile for bwrap)")


def userns_problem(bwrap: str = "/usr/bin/bwrap") -> str:
    """Why this user cannot start a bubblewrap user namespace here, or "" if it can (one `bwrap ... true`)."""
    if not os.access(bwrap, os.X_OK):
        return f"bubblewrap not found at {bwrap} (apt-get install bubblewrap)"
    try:
        p = subprocess.run([bwrap, "--unshare-user", "--unshare-pid", "--disable-userns", "--ro-bind", "/usr", "/usr",
                            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                            "--proc", "/proc", "--dev", "/dev", "--", "/usr/bin/true"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap did not run: {e}"
    if p.returncode != 0:
        return f"bubblewrap cannot create a user namespace as uid {os.getuid()} ({p.stderr.strip() or p.returncode})"
    return ""


def _state_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.access(base, os.W_OK):
        return Path(base) / "jointrl-sandbox"
    return Path(tempfile.gettempdir()) / f"jointrl-sandbox-{os.getuid()}"


class RootlessBwrapSandbox(BwrapSandbox):
    """A `BwrapSandbox` in a user namespace of its own, from an unprivileged user (see the module docstring)."""

    def __init__(self, backend: "RootlessBwrapBackend", slot: hostctl.Slot, limits, binds, *, agent_inside, pristine,
                 usr=None) -> None:
        self._set_state(backend, slot, limits, binds, agent_inside=agent_inside, pristine=pristine, usr=usr)
        self.slot_dir = self.config.state_dir / f"slot-{slot.uid}"
        shutil.rmtree(self.slot_dir, ignore_errors=True)  # a crashed owner's leftovers (its processes died with it)
        self.slot_dir.mkdir(mode=0o700)
        self.workdir_host = self.slot_dir / "work"
        self.workdir_host.mkdir(mode=0o700)
        self.cgroup = None
        if self.config.use_cgroups:
            mem_mb = self.config.memory_mb or (limits.address_space_mb + limits.workdir_mb + limits.tmp_mb
                                               + self.config.shm_mb + 64)
            cg = hostctl.SlotCgroup(f"jointrl-rootless-{os.getuid()}-{slot.uid}", max_pids=limits.max_procs + 2,
                                    memory_bytes=mem_mb * (1 << 20))
            self.cgroup = cg if cg.ok else None  # a delegated cgroup, where the user has one

    def _prlimit_args(self) -> list[str]:
        # NPROC would count every process of this user (the run included) on the host: the executor sets it
        # inside the namespace instead (`_bwrap_args`).
        return [a for a in super()._prlimit_args() if not a.startswith("--nproc=")]

    def _bwrap_args(self, fds) -> list[str]:
        a = super()._bwrap_args(fds)
        for i, (host, _) in enumerate(self._binds):  # bind the host paths themselves: this user can read them
            a[a.index(str(self.slot_dir / "mnt" / str(i)))] = host
        return a + [str(self.limits.max_procs + 1)]  # the executor's RLIMIT_NPROC inside the namespace (+ itself)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        from envs.sandbox import safefs

        if self._closed:
            raise RuntimeError(f"sandbox slot {self.uid} is closed")
        safefs.write_file(str(self.workdir_host), path, data, mode, owner=None)  # already this user's

    def kill_all(self) -> None:
        """Kill the namespace's pid 1: the kernel kills every process in the namespace (setsid daemons too)."""
        self._kill_namespace_unlocked()
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.kill_all()
        finally:
            try:
                for d, _, files in os.walk(self.slot_dir):  # the agent may have left read-only directories
                    os.chmod(d, 0o700)
                shutil.rmtree(self.slot_dir, ignore_errors=True)
                if self.cgroup is not None:
                    self.cgroup.remove()
            finally:
                self.backend._slots.release(self._slot)
                self.backend._open_boxes.discard(self)

    def __repr__(self) -> str:
        return f"RootlessBwrapSandbox(slot={self.uid}, pristine={self.pristine}, closed={self._closed})"


class RootlessBwrapBackend(BwrapBackend):
    """`BwrapBackend` for an unprivileged user; `BwrapBackend()` returns one when the process is not root."""

    sandbox_cls = RootlessBwrapSandbox

    def __init__(self, config: BwrapConfig | None = None) -> None:
        import threading  # noqa: F401 - BwrapSandbox's locks
        import weakref
        import atexit
        from concurrent.futures import ThreadPoolExecutor
        from dataclasses import replace

        config = config or BwrapConfig()
        if config.state_dir == BwrapConfig().state_dir:  # /run/... is root's: use this user's own state dir
            config = replace(config, state_dir=_state_dir())
        self.config = config
        problem = userns_problem(config.bwrap)
        if problem:
            raise SandboxUnavailable(f"no sandbox: not root, and {problem}. To run the terminal, SWE and CAD domains, "
                                     f"{USERNS_HELP}; refusing to run commands unsandboxed")
        if not os.access(config.prlimit, os.X_OK):
            raise SandboxUnavailable(f"prlimit not found at {config.prlimit} (apt-get install util-linux)")
        if not os.path.realpath(config.python).startswith("/usr/") or not os.access(config.python, os.X_OK):
            raise SandboxUnavailable(f"{config.python} must be an executable python3 under /usr")
        self._seccomp = compile_filter()
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(config.state_dir, 0o700)
        # slot numbers are names here (the uid inside each namespace), never host identities
        self._slots = hostctl.SlotAllocator(config.state_dir / "locks", config.first_uid, config.n_slots)
        self._open_boxes = weakref.WeakSet()
        self._warned_cgroup = True  # said once below, with everything else that is absent
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bwrap-spawner")
        self.sweep_stale()
        atexit.register(self._close_all)
        log.warning(ROOTLESS_LIMITS)

    def _spawn(self, args: list[str], **popen_kw) -> subprocess.Popen:
        for k in ("user", "group", "extra_groups"):  # no uid switch without root: bwrap maps this user
            popen_kw.pop(k, None)
        return super()._spawn(args, **popen_kw)

    def sweep_stale(self) -> list[int]:
        """Remove the directories of slots no live process holds (their processes died with their owner:
        bwrap's --die-with-parent)."""
        cleaned = []
        for uid in self._slots.uids:
            slot = self._slots.try_acquire(uid)
            if slot is None:
                continue
            try:
                d = self.config.state_dir / f"slot-{uid}"
                if d.exists():
                    shutil.rmtree(d, ignore_errors=True)
                    cleaned.append(uid)
            finally:
                self._slots.release(slot)
        return cleaned
