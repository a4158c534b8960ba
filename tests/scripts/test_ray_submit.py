"""The cluster launcher as users run it: `ray start --head` on this machine, then
`scripts/ray_submit.py` (`ray job submit` underneath) runs a short `configs/basics.yaml` job (1 SFT
step, 1 RL step, tiny HybridMoe) to completion; its logs come back through the launcher and Ray's
job API, and its run directory is where the launcher said.

The head runs with `--block` in a session of its own and is stopped by signalling that session:
`ray stop` would stop every Ray process on the machine, other users' included. It uses Ray's token
authentication with a token of its own (`RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN`), which the
launcher's environment passes to `ray job submit`, as on a secured cluster. The cluster's Python is
this project's `.venv` (`--no-pip`); its caches are the repository's `.cache` (vLLM compile cache,
DeepSpeed's built extension), so the job does not rebuild them.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from tests import REPO

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    with ExitStack() as stack:
        for s in socks:
            stack.enter_context(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


TOKEN = secrets.token_hex(32)


def _env() -> dict[str, str]:
    """The head's, the launcher's and the `ray job` commands' environment: this .venv first on PATH,
    no Ray settings of this process, the test cluster's own token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    return env


def _ray_job(*args: str) -> str:
    r = subprocess.run([RAY, "job", *args], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _stop_session(leader: subprocess.Popen) -> None:
    """SIGTERM to the head's session (its raylet, GCS, dashboard and workers), SIGKILL to what is left."""
    import psutil

    def members() -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == leader.pid:
                    out.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        return out

    try:
        os.killpg(leader.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs(members(), timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    leader.wait(timeout=30)


@contextmanager
def ray_head(temp_dir: Path, log_path: Path, num_cpus: int = 4):
    """`ray start --head` on free ports; yields the dashboard (job submission) address."""
    gcs, dash, client, agent_http, agent_grpc, metrics, env_agent = _free_ports(7)
    cmd = [RAY, "start", "--head", "--block", f"--port={gcs}", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={env_agent}", "--disable-usage-stats"]
    log = open(log_path, "w")
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 180
        while True:
            assert head.poll() is None, f"ray start exited {head.returncode}:\n{log_path.read_text()[-3000:]}"
            try:
                req = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {TOKEN}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, f"the dashboard did not come up:\n{log_path.read_text()[-3000:]}"
            time.sleep(1)
        yield address
    finally:
        _stop_session(head)
        log.close()


def test_ray_start_head_then_ray_submit_runs_a_short_job(tmp_path):
    temp_dir = Path(tempfile.mkdtemp(prefix="rs-", dir=REPO / ".cache"))  # short: Ray's socket paths live under it
    run_root = tmp_path / "cluster_runs"
    sid = f"jointrl-test-{os.getpid()}-{int(time.time())}"
    overrides = ["name=submit-test", "trainer.sft_steps=1", "trainer.sft_tasks_per_domain=2", "trainer.steps=1",
                 "trainer.tasks_per_step=2", "trainer.micro_batch_size=4", "trainer.checkpoint_every=1",
                 "algorithm.group_size=2", "algorithm.dynamic_sampling=off", "rollout.max_new_tokens_per_turn=32",
                 "envs.max_turns=2", "eval.n_per_domain=1", "eval.samples=1"]
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, temp_dir, ignore_errors=True)
        address = stack.enter_context(ray_head(temp_dir, tmp_path / "head.log"))
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "scripts/ray_submit.py", "--address", address, "--no-pip", "--python", sys.executable,
                            "--cache-dir", str(REPO / ".cache"), "--run-root", str(run_root), "--wandb-mode", "disabled",
                            "--submission-id", sid, "configs/basics.yaml", *overrides],
                           capture_output=True, text=True, cwd=REPO, env=_env(), timeout=900)
        took = time.perf_counter() - t0
        status = _ray_job("status", "--address", address, sid)
        logs = _ray_job("logs", "--address", address, sid)
    print(f"job {sid} in {took:.1f} s: {status.strip()[-300:]}\n--- launcher stderr\n{r.stderr[-3000:]}\n"
          f"--- job log tail\n{logs[-3000:]}")
    assert r.returncode == 0 and f"Job '{sid}' succeeded" in status, r.stdout[-5000:] + r.stderr[-3000:]
    run_dir = run_root / "runs" / "submit-test"
    assert f"ray_submit: job {sid}: run directory {run_dir}" in r.stderr
    assert f"ray_submit: job {sid} succeeded" in r.stderr
    # The job's logs came back twice: streamed by the launcher, and from `ray job logs`.
    for text in (r.stdout, logs):
        assert "held-out evaluation: before RL (after SFT) | after RL" in text
    assert f"Job '{sid}' succeeded" in r.stdout
    # The run directory is where the launcher said: metrics of the one RL step and its checkpoint.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "reward/mean/terminal" in row] == [0]
    assert (run_dir / "sft_metrics.jsonl").exists() and (run_dir / "eval_table.txt").exists()
    assert json.loads((run_dir / "checkpoint" / "meta.json").read_text())["step"] == 1
    assert (run_dir / "checkpoint" / "hf" / "config.json").exists()
