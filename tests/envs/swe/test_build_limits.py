"""Build-time suite runs are capped in memory: a mutation that allocates without end fails with
MemoryError inside the cap instead of taking the machine's memory (envs/swe/runner.py)."""
from __future__ import annotations

import subprocess
import sys

from envs.swe import runner


def test_build_child_gets_the_address_space_and_cpu_caps():
    code = "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_CPU)[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=runner._cap_build_child, check=True)
    assert [int(x) for x in out.stdout.split()] == [runner.BUILD_ADDRESS_SPACE_BYTES, runner.BUILD_CPU_SECONDS]


def test_build_child_dies_with_its_parent(tmp_path):
    # parent starts a capped child that would sleep for a minute, then the parent is killed: the child goes too
    pidfile = tmp_path / "child.pid"
    parent = ("import subprocess, sys, time\n"
              "from envs.swe import runner\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=runner._cap_build_child)\n"
              f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(60)\n")
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.time() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    child = int(pidfile.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break  # exited, waiting for init to reap it
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the capped child outlived its killed parent")


def test_a_runaway_allocation_fails_inside_the_cap():
    # 8 GiB in 64 MiB steps: without the cap this would succeed on a 24 GiB machine (and hurt it)
    code = ("chunks = []\n"
            "try:\n"
            "    for _ in range(128):\n"
            "        chunks.append(bytearray(64 << 20))\n"
            "    print('allocated', len(chunks))\n"
            "except MemoryError:\n"
            "    print('capped at', len(chunks))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=runner._cap_build_child, timeout=60)
    assert out.stdout.startswith("capped at"), out.stdout + out.stderr
    assert int(out.stdout.split()[-1]) * (64 << 20) <= runner.BUILD_ADDRESS_SPACE_BYTES
