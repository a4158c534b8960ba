"""Starting `jointrl tinker serve` as a child process and waiting until it answers its health probe.

One launcher for the callers that need a live service: the benchmark (scripts/bench_tinker.py), the
tinker-cookbook check (scripts/tinker_cookbook_check.py) and the SDK tests (tests/rl/tinker/). `launch` picks a
free port, starts the service with its output in a log file, and returns once `GET /api/v1/healthz` answers
200; a service that exits first, or stays silent past the deadline, raises `LaunchError` with the log's tail.

What it does not do: build checkpoints, or talk the Tinker protocol (the `tinker` SDK does that).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from jointrl.paths import REPO_ROOT
from rl.http_io import free_port

HEALTH = "/api/v1/healthz"  # rl/tinker/app.py's open route


class LaunchError(RuntimeError):
    """The service exited, or did not answer its health probe in time; the message ends with its log's tail."""


@dataclass
class Launched:
    """A running service: its process, base URL (the SDK's `base_url`), log file and the command that started it."""

    proc: subprocess.Popen
    url: str
    log: Path
    cmd: list[str]

    def stop(self, wait_s: float = 30) -> None:
        """SIGTERM (the service drains and shuts its engines down), SIGKILL after `wait_s`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def launch(model: str | Path, *, state_dir: Path, log: Path, api_key: str, args: Sequence[str] = (),
           program: Sequence[str] = (sys.executable, "-m", "rl.tinker"), timeout_s: float = 180) -> Launched:
    """Start `<program> serve MODEL --port P --api-key KEY --state-dir DIR <args>` (telemetry off) and wait for
    its health probe. `program` is how the service is invoked (default: this interpreter's `-m rl.tinker`;
    the installed `jointrl tinker` works the same)."""
    import httpx

    port = free_port()
    cmd = [*map(str, program), "serve", str(model), "--port", str(port), "--api-key", api_key, "--state-dir", str(state_dir),
           *map(str, args)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TINKER_TELEMETRY": "0"})
    launched = Launched(proc, f"http://127.0.0.1:{port}", Path(log), cmd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"the tinker service exited with {proc.returncode} before it was healthy; "
                              f"its log ({log}) ends:\n{Path(log).read_text()[-3000:]}")
        try:
            if httpx.get(launched.url + HEALTH, timeout=1).status_code == 200:
                return launched
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    launched.stop()
    raise LaunchError(f"the tinker service did not answer {HEALTH} in {timeout_s:.0f} s; its log ({log}) ends:\n"
                      f"{Path(log).read_text()[-3000:]}")
