"""`run_until_stopped`: a real uvicorn in a child process; SIGTERM and SIGINT must let the clean-up after it run."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
from rl.jobs.server import free_port

CHILD = textwrap.dedent("""
    import sys, time
    from rl.http_run import run_until_stopped

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"up"})

    out = sys.argv[2]
    try:
        got = run_until_stopped(app, "127.0.0.1", int(sys.argv[1]), log_level="warning")
        open(out + ".draining", "w").write("")
        time.sleep(float(sys.argv[3]))  # a drain: a repeated SIGTERM lands in here
        open(out, "w").write(f"cleaned {got}")
    finally:
        open(out + ".finally", "w").write("ran")
""")


def _start(out: Path, drain_s: float, child: str = CHILD) -> tuple[subprocess.Popen, Path]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", child, str(port), str(out), str(drain_s)], cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline
        try:
            if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).text == "up":
                return proc, out
        except httpx.HTTPError:
            time.sleep(0.1)


def _wait_draining(proc: subprocess.Popen, out: Path) -> None:
    """Until the child has left uvicorn and entered its drain (the clean-up after run_until_stopped)."""
    deadline = time.monotonic() + 30
    while not Path(f"{out}.draining").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def test_sigterm_returns_to_the_caller_and_a_repeated_term_does_not_cut_the_drain(tmp_path):
    proc, out = _start(tmp_path / "out", drain_s=1.5)
    proc.send_signal(signal.SIGTERM)
    _wait_draining(proc, out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert out.read_text() == f"cleaned {int(signal.SIGTERM)}"


def test_sigint_returns_to_the_caller_and_a_second_one_forces_the_exit(tmp_path):
    proc, out = _start(tmp_path / "first", drain_s=0.0)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert out.read_text() == f"cleaned {int(signal.SIGINT)}"

    proc, out = _start(tmp_path / "second", drain_s=30.0)
    proc.send_signal(signal.SIGINT)
    _wait_draining(proc, out)
    proc.send_signal(signal.SIGINT)  # during the 30 s drain: KeyboardInterrupt, the finally still runs
    assert proc.wait(timeout=20) != 0
    assert not out.exists() and Path(f"{out}.finally").read_text() == "ran"


def test_plain_uvicorn_run_skips_the_finally_on_sigterm(tmp_path):
    """The reason for the helper: with uvicorn.run alone the re-raised SIGTERM kills the process before the finally."""
    child = CHILD.replace("from rl.http_run import run_until_stopped",
                          "import uvicorn\nrun_until_stopped = lambda app, h, p, **kw: uvicorn.run(app, host=h, port=p, **kw)")
    proc, out = _start(tmp_path / "out", drain_s=0.0, child=child)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not Path(f"{out}.finally").exists()
