"""The jointrl side of the bridge: the verifiers venv, and one long-lived bridge process per environment.

`verifiers_python()` is the interpreter of the venv that holds verifiers and the environment packages
(`$JOINTRL_VERIFIERS_PYTHON`, else `<cache>/verifiers-venv/bin/python`, which scripts/setup.sh builds).
`Bridge(spec)` starts `bridge.py serve` under it on first use and sends one request at a time (a lock);
a bridge that dies or overruns `timeout_s` is killed and started again on the next request, and the
request fails with `BridgeError`. `describe` is asked once per process and environment (cached).

What runs here: loading the environment, its dataset and its rubric, in the bridge's process, never in
the policy's or the driver's. Tools are not called through this process (envs/verifiers_adapter/domain.py
runs each call in the sandbox).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from jointrl.paths import cache_root

BRIDGE = Path(__file__).with_name("bridge.py")
PYTHON_ENV = "JOINTRL_VERIFIERS_PYTHON"
ADDRESS_SPACE_BYTES = 4 << 30  # the bridge's RLIMIT_AS: a runaway rubric ends the bridge only


class BridgeError(RuntimeError):
    """The bridge could not answer (it died, overran, or the environment raised)."""


def verifiers_python() -> Path:
    p = os.environ.get(PYTHON_ENV)
    return Path(p) if p else cache_root() / "verifiers-venv" / "bin" / "python"


@dataclass(frozen=True)
class LoaderRef:
    """How the bridge builds the environment: `module:function` in the verifiers venv, with keyword args."""

    target: str
    kwargs_json: str = "{}"

    def argv(self) -> list[str]:
        return [self.target, self.kwargs_json]


def _limit() -> None:  # in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Bridge:
    def __init__(self, loader: LoaderRef, timeout_s: float = 60.0, start_timeout_s: float = 180.0) -> None:
        self.loader = loader
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._fresh = False  # the next request is the first of a new process (it pays the start-up)
        self.restarts = 0

    def _start(self) -> subprocess.Popen:
        py = verifiers_python()
        if not py.exists():
            raise BridgeError(f"the verifiers venv's python {py} does not exist (scripts/setup.sh builds it; "
                              f"or set {PYTHON_ENV})")
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PYTHONDONTWRITEBYTECODE": "1",
               "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self._fresh = True
        return subprocess.Popen([str(py), "-I", str(BRIDGE), "serve", *self.loader.argv()], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                start_new_session=True, preexec_fn=_limit, env=env, cwd="/")

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, 9)
            except ProcessLookupError:
                pass
            self._proc.wait()
            self._proc = None
            self.restarts += 1

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            deadline = self.start_timeout_s if self._fresh else self.timeout_s
            self._fresh = False
            line = self._exchange(json.dumps(body), deadline)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise BridgeError(f"bridge for {self.loader.target} sent a line that is not JSON: {line[:200]!r}") from None
        if not reply.get("ok"):
            raise BridgeError(f"{self.loader.target}: {reply.get('error', 'no error text')}")
        return reply

    def _exchange(self, text: str, deadline: float) -> str:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        out: list[str] = []

        def read() -> None:
            out.append(proc.stdout.readline())

        try:
            proc.stdin.write(text + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._kill()
            raise BridgeError(f"bridge for {self.loader.target} died before the request") from None
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(deadline)
        if t.is_alive() or not out or not out[0]:
            why = f"no reply within {deadline:.0f} s" if t.is_alive() else "it exited"
            self._kill()
            raise BridgeError(f"bridge for {self.loader.target}: {why}")
        return out[0]

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill()
                self.restarts -= 1


_BRIDGES: dict[LoaderRef, Bridge] = {}
_BRIDGES_LOCK = threading.Lock()


def shared_bridge(loader: LoaderRef) -> Bridge:
    """One bridge per environment per process: every env instance of the domain shares it."""
    with _BRIDGES_LOCK:
        if loader not in _BRIDGES:
            _BRIDGES[loader] = Bridge(loader)
        return _BRIDGES[loader]


@lru_cache(maxsize=None)
def describe(loader: LoaderRef) -> dict[str, Any]:
    """The environment's kind, tools, reward functions and dataset rows (bridge.py's `describe`)."""
    return shared_bridge(loader).request({"op": "describe"})
