"""The seccomp program: syscall numbers vs libseccomp, and the compiled BPF vs the policy as written.

The BPF program is executed by a small, obvious classic-BPF interpreter written here from
`include/uapi/linux/filter.h` and compared with `reference_policy`, a direct transcription of the
module docstring's deny-list. Behaviour in the real kernel is tested in test_sandbox_attacks.py.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import random
import struct

import pytest

from envs.sandbox import seccomp as sc

ARCHES = (sc.AUDIT_ARCH_X86_64, sc.AUDIT_ARCH_AARCH64)


def _libseccomp():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    return lib


@pytest.mark.parametrize("arch", ARCHES)
def test_syscall_numbers_match_libseccomp(arch):
    lib = _libseccomp()
    if lib is None:
        pytest.skip("libseccomp.so.2 not installed (only used as a cross-check)")
    for name, nr in sc.SYSCALLS[arch].items():
        # SCMP_ARCH_* tokens are the AUDIT_ARCH_* values.
        assert lib.seccomp_syscall_resolve_name_arch(arch, name.encode()) == nr, (hex(arch), name)


def run_bpf(prog: list[sc.Insn], data: bytes) -> int:
    """Interpret classic BPF as the kernel does for seccomp (A register, absolute word loads)."""
    a = 0
    pc = 0
    steps = 0
    while True:
        steps += 1
        assert steps < 10_000, "BPF program loops"
        ins = prog[pc]
        cls = ins.code & 0x07
        if cls == sc.BPF_LD:
            assert ins.code == sc.BPF_LD | sc.BPF_W | sc.BPF_ABS and ins.k % 4 == 0
            (a,) = struct.unpack_from("<I", data, ins.k)
            pc += 1
        elif cls == sc.BPF_RET:
            return ins.k
        elif cls == sc.BPF_JMP:
            op = ins.code & 0xF0
            if op == sc.BPF_JA:
                pc += 1 + ins.k
                continue
            cond = {sc.BPF_JEQ: a == ins.k, sc.BPF_JGE: a >= ins.k, sc.BPF_JSET: (a & ins.k) != 0}[op]
            pc += 1 + (ins.jt if cond else ins.jf)
        else:
            raise AssertionError(f"unexpected opcode {ins.code:#x}")


def seccomp_data(arch: int, nr: int, args: tuple[int, ...] = ()) -> bytes:
    args6 = list(args) + [0] * (6 - len(args))
    return struct.pack("<iIQ6Q", nr, arch, 0x401000, *args6)


def reference_policy(prog_arch: int, arch: int, nr: int, args: tuple[int, ...]) -> int:
    """The deny-list, written directly from the module docstring."""
    if arch != prog_arch:
        return sc.SECCOMP_RET_KILL_PROCESS
    table = sc.SYSCALLS[arch]
    by_nr = {v: k for k, v in table.items()}
    if arch == sc.AUDIT_ARCH_X86_64 and nr >= 0x40000000:
        return sc.ret_errno(errno.EPERM)
    name = by_nr.get(nr)
    a0 = (args[0] if args else 0) & 0xFFFFFFFF
    if name in sc.DENY_ALWAYS:
        return sc.ret_errno(errno.EPERM)
    if name == "clone3":
        return sc.ret_errno(errno.ENOSYS)
    if name in ("clone", "unshare") and a0 & sc.CLONE_NS_MASK:
        return sc.ret_errno(errno.EPERM)
    if name == "socket" and a0 in (sc.AF_INET, sc.AF_INET6):
        return sc.ret_errno(errno.EAFNOSUPPORT)
    return sc.SECCOMP_RET_ALLOW


@pytest.mark.parametrize("arch", ARCHES)
def test_program_matches_reference_policy(arch):
    prog = sc.build_program(arch)
    table = sc.SYSCALLS[arch]
    rng = random.Random(0)
    cases = []
    interesting_args = [0, sc.CLONE_NEWUSER, sc.CLONE_NEWNET | 0x11, 0x11 | (sc.CLONE_NEWUSER << 32),
                        (1 << 32) | sc.AF_INET, sc.AF_INET, sc.AF_INET6, 1, 16, 0xFFFFFFFF, 0x01200011]
    for nr in list(table.values()) + list(range(0, 460)):
        for a0 in interesting_args:
            cases.append((nr, (a0, rng.getrandbits(64))))
    for _ in range(2000):
        cases.append((rng.randrange(0, 1 << 31), tuple(rng.getrandbits(64) for _ in range(6))))
    cases.append((0x40000000 + 41, (1,)))
    for data_arch in (arch, *(a for a in ARCHES if a != arch), 0x40000003):
        for nr, args in cases:
            got = run_bpf(prog, seccomp_data(data_arch, nr, args))
            want = reference_policy(arch, data_arch, nr, args)
            assert got == want, (hex(arch), hex(data_arch), nr, [hex(a) for a in args])


def test_spot_checks_x86_64():
    """A few decisions spelled out by hand, so the reference itself is pinned."""
    prog = sc.build_program(sc.AUDIT_ARCH_X86_64)
    allow, eperm = sc.SECCOMP_RET_ALLOW, sc.ret_errno(errno.EPERM)
    x = sc.AUDIT_ARCH_X86_64
    assert run_bpf(prog, seccomp_data(x, 0)) == allow  # read
    assert run_bpf(prog, seccomp_data(x, 56, (0x01200011,))) == allow  # glibc fork()'s clone flags
    assert run_bpf(prog, seccomp_data(x, 56, (0x10000000,))) == eperm  # clone(CLONE_NEWUSER)
    assert run_bpf(prog, seccomp_data(x, 272, (0x10000000,))) == eperm  # unshare(CLONE_NEWUSER)
    assert run_bpf(prog, seccomp_data(x, 272, (0x00000200,))) == allow  # unshare(CLONE_FS)
    assert run_bpf(prog, seccomp_data(x, 435)) == sc.ret_errno(errno.ENOSYS)  # clone3
    assert run_bpf(prog, seccomp_data(x, 101)) == eperm  # ptrace
    assert run_bpf(prog, seccomp_data(x, 41, (2, 1, 0))) == sc.ret_errno(errno.EAFNOSUPPORT)  # AF_INET
    assert run_bpf(prog, seccomp_data(x, 41, (1, 1, 0))) == allow  # AF_UNIX
    assert run_bpf(prog, seccomp_data(x, 0x40000000 | 41, (1,))) == eperm  # x32 ABI
    assert run_bpf(prog, seccomp_data(0x40000003, 1)) == sc.SECCOMP_RET_KILL_PROCESS  # i386 ABI


def test_compiled_bytes_are_sock_filters():
    blob = sc.compile_filter(sc.AUDIT_ARCH_X86_64)
    prog = sc.build_program(sc.AUDIT_ARCH_X86_64)
    assert len(blob) == 8 * len(prog)
    code, jt, jf, k = struct.unpack_from("<HBBI", blob, 8 * 1)
    assert (code, jt, jf, k) == (prog[1].code, prog[1].jt, prog[1].jf, prog[1].k)


def test_unknown_arch_refused():
    from envs.sandbox.base import SandboxUnavailable

    with pytest.raises(SandboxUnavailable, match="no seccomp syscall table"):
        sc.build_program(0x40000003)
