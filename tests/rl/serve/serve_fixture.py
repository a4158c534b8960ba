"""Start `jointrl serve` as a subprocess on a free port, wait until /health answers, stop it afterwards."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from model import chat
from rl.http_io import free_port  # noqa: F401 - the serve tests take it from here
from rl.serve import read_records

from tests import REPO

STARTUP_TIMEOUT_S = 300


class Server:
    """A running server: its URL, an `openai` client, the tokenizer, and its JSONL records by id."""

    def __init__(self, port: int, record_dir: Path, model_name: str) -> None:
        self.port, self.record_dir, self.model = port, record_dir, model_name
        self.base = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", timeout=180, max_retries=0)
        self.tok = chat.load_tokenizer()

    def record(self, rid: str):
        return {r.id: r for r in read_records(self.record_dir)}[rid]


@contextlib.contextmanager
def running_server(model: str, tmp: Path, served_name: str | None = None, extra_args: tuple[str, ...] = ()) -> Iterator[Server]:
    port = free_port()
    record_dir = tmp / "records"
    exe = Path(sys.executable).with_name("jointrl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "rl.cli"]
    cmd += ["serve", model, "--host", "127.0.0.1", "--port", str(port), "--record-dir", str(record_dir), *extra_args]
    log_path = tmp / "server.log"
    with open(log_path, "w") as log_f:
        proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=log_f, stderr=subprocess.STDOUT, env={**os.environ, "JOINTRL_PROGRESS": "0"})
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jointrl serve exited with {proc.returncode} before it was ready:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jointrl serve not ready after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield Server(port, record_dir, served_name or Path(model).name)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
