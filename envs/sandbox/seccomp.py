"""A seccomp-BPF deny-list for agent sandboxes, compiled in pure Python (no libseccomp needed).

What it does: builds the classic-BPF program that `bwrap --seccomp FD` loads into every sandboxed
process. The program checks the syscall's architecture (a foreign or x32 ABI is refused, so the
deny-list cannot be bypassed through another syscall table), then returns an errno for:

* nested namespaces: `clone` / `unshare` with any CLONE_NEW* flag (CLONE_NEWUSER is the one that
  would hand the agent capabilities), `setns`, and `clone3` (its flags live in a struct that BPF
  cannot read, so it gets ENOSYS and glibc falls back to `clone`, which we can inspect);
* debugging other processes: `ptrace`, `process_vm_readv/writev`, `pidfd_getfd`, `perf_event_open`;
* mount machinery (old and new API), `pivot_root`, `chroot`;
* `bpf`, `io_uring_*`, `userfaultfd`, the key-ring (`keyctl`, `add_key`, `request_key`);
* inet sockets: `socket(AF_INET|AF_INET6, ...)` (AF_UNIX stays allowed for local IPC);
* host-administration calls that need capabilities anyway (modules, kexec, reboot, swap, ...),
  blocked so a kernel bug in their permission checks is not reachable.

What it does not do: it is a deny-list, not an allow-list (most of the isolation comes from the
namespaces, the unprivileged uid and the read-only mounts); it does not filter `ioctl` or file
syscalls. Only x86_64 and aarch64 are supported; other machines raise `SandboxUnavailable`.

Layout of `struct seccomp_data` and the return-action encoding are from the kernel's
`include/uapi/linux/seccomp.h` and `Documentation/userspace-api/seccomp_filter.rst`; the BPF
opcodes from `include/uapi/linux/filter.h`. Syscall numbers are cross-checked against libseccomp
in the tests.
"""
from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

from envs.sandbox.base import SandboxUnavailable

# --- classic BPF opcodes (include/uapi/linux/bpf_common.h) ---
BPF_LD, BPF_JMP, BPF_RET = 0x00, 0x05, 0x06
BPF_W, BPF_ABS, BPF_K = 0x00, 0x20, 0x00
BPF_JA, BPF_JEQ, BPF_JGE, BPF_JSET = 0x00, 0x10, 0x30, 0x40

# --- seccomp return actions (include/uapi/linux/seccomp.h) ---
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_DATA = 0x0000FFFF

# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
OFF_NR, OFF_ARCH = 0, 4


def off_arg_lo(i: int) -> int:
    """Offset of the low 32 bits of syscall argument `i` (little-endian: low word first)."""
    return 16 + 8 * i


AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

# Namespace flags for clone/unshare (include/uapi/linux/sched.h).
CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NS_MASK = (CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC
                 | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET)

AF_INET, AF_INET6 = 2, 10

# Syscall numbers per architecture (x86_64: arch/x86/entry/syscalls/syscall_64.tbl;
# aarch64: include/uapi/asm-generic/unistd.h). Checked against libseccomp in tests.
SYSCALLS: dict[int, dict[str, int]] = {
    AUDIT_ARCH_X86_64: {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
        "perf_event_open": 298, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442, "setns": 308, "bpf": 321, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323, "keyctl": 250,
        "add_key": 248, "request_key": 249, "kexec_load": 246, "kexec_file_load": 320,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "acct": 163,
        "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103, "quotactl": 179,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "iopl": 172, "ioperm": 173,
        "clone": 56, "clone3": 435, "unshare": 272, "socket": 41,
    },
    AUDIT_ARCH_AARCH64: {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
        "perf_event_open": 241, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442, "setns": 268, "bpf": 280, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 282, "keyctl": 219,
        "add_key": 217, "request_key": 218, "kexec_load": 104, "kexec_file_load": 294,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "acct": 89,
        "swapon": 224, "swapoff": 225, "reboot": 142, "syslog": 116, "quotactl": 60,
        "name_to_handle_at": 264, "open_by_handle_at": 265,
        "clone": 220, "clone3": 435, "unshare": 97, "socket": 198,
    },
}

# Always refused with EPERM, whatever the arguments.
DENY_ALWAYS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "perf_event_open",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "setns", "bpf", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "userfaultfd", "keyctl", "add_key", "request_key", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "swapon", "swapoff",
    "reboot", "syslog", "quotactl", "name_to_handle_at", "open_by_handle_at", "iopl", "ioperm",
)


def ret_errno(err: int) -> int:
    return SECCOMP_RET_ERRNO | (err & SECCOMP_RET_DATA)


@dataclass(frozen=True)
class Insn:
    """One `struct sock_filter` instruction."""

    code: int
    jt: int
    jf: int
    k: int

    def pack(self) -> bytes:
        if not (0 <= self.jt <= 255 and 0 <= self.jf <= 255):
            raise ValueError(f"BPF jump offset out of range in {self}")
        return struct.pack("<HBBI", self.code, self.jt, self.jf, self.k & 0xFFFFFFFF)


def _ld(off: int) -> Insn:
    return Insn(BPF_LD | BPF_W | BPF_ABS, 0, 0, off)


def _jeq(k: int, jt: int, jf: int) -> Insn:
    return Insn(BPF_JMP | BPF_JEQ | BPF_K, jt, jf, k)


def _ret(k: int) -> Insn:
    return Insn(BPF_RET | BPF_K, 0, 0, k)


def native_audit_arch() -> int:
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        return AUDIT_ARCH_X86_64
    if machine in ("aarch64", "arm64"):
        return AUDIT_ARCH_AARCH64
    raise SandboxUnavailable(f"no seccomp syscall table for machine {machine!r} (supported: x86_64, aarch64)")


def build_program(arch: int | None = None) -> list[Insn]:
    """The filter as a list of instructions (see the module docstring for the policy)."""
    arch = native_audit_arch() if arch is None else arch
    if arch not in SYSCALLS:
        raise SandboxUnavailable(f"no seccomp syscall table for audit arch {arch:#x}")
    nr = SYSCALLS[arch]
    eperm = ret_errno(errno.EPERM)
    prog: list[Insn] = [
        _ld(OFF_ARCH),
        _jeq(arch, 1, 0),
        _ret(SECCOMP_RET_KILL_PROCESS),  # a foreign ABI (e.g. int 0x80 on x86_64): no table to check
        _ld(OFF_NR),
    ]
    if arch == AUDIT_ARCH_X86_64:
        # x32 syscalls share the arch value but set bit 30 of nr; refuse them all.
        prog += [Insn(BPF_JMP | BPF_JGE | BPF_K, 0, 1, X32_SYSCALL_BIT), _ret(eperm)]
    for name in DENY_ALWAYS:
        if name in nr:  # iopl/ioperm exist only on x86
            prog += [_jeq(nr[name], 0, 1), _ret(eperm)]
    prog += [_jeq(nr["clone3"], 0, 1), _ret(ret_errno(errno.ENOSYS))]
    # clone(flags, ...) and unshare(flags): refuse any namespace flag. A = nr on entry and exit.
    for name in ("clone", "unshare"):
        prog += [
            _jeq(nr[name], 0, 4),
            _ld(off_arg_lo(0)),
            Insn(BPF_JMP | BPF_JSET | BPF_K, 0, 1, CLONE_NS_MASK),
            _ret(eperm),
            _ld(OFF_NR),
        ]
    # socket(domain, ...): the kernel reads `domain` as an int, so the low word decides.
    prog += [
        _jeq(nr["socket"], 0, 5),
        _ld(off_arg_lo(0)),
        _jeq(AF_INET, 2, 0),
        _jeq(AF_INET6, 1, 0),
        Insn(BPF_JMP | BPF_JA, 0, 0, 1),
        _ret(ret_errno(errno.EAFNOSUPPORT)),
        _ld(OFF_NR),
    ]
    prog.append(_ret(SECCOMP_RET_ALLOW))
    return prog


def compile_filter(arch: int | None = None) -> bytes:
    """The packed program, ready for `bwrap --seccomp FD` (an array of 8-byte sock_filter)."""
    prog = build_program(arch)
    if len(prog) > 4096:  # BPF_MAXINSNS
        raise ValueError("seccomp program too long")
    return b"".join(insn.pack() for insn in prog)
