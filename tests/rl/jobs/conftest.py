"""Fixtures of the jobs tests: a real redis-server, a real moto S3 server, the tiny checkpoint, a policy server."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from rl.jobs.server import free_port


@pytest.fixture(scope="session")
def redis_url():
    from rl.jobs.broker import RedisProcess

    port = free_port()
    proc = RedisProcess(port)
    yield f"redis://127.0.0.1:{port}/0"
    proc.stop()


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3-API server on loopback; AWS_* variables point s3fs at it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
            time.sleep(0.2)
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="jointrl")
    yield url
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from model.shipped import build_random_checkpoint

    return build_random_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


POLICY_KEY = "policy-key-of-the-tests"


@pytest.fixture(scope="session")
def policy_url(tiny_ckpt, tmp_path_factory):
    """One policy server (a real vLLM engine over the tiny HybridMoe) for every test of the session. Its key
    is POLICY_KEY, also put in this process's $JOINTRL_POLICY_API_KEY, which the jobs servers and workers the
    tests start inherit (a jobs server given --policy-url reads the policy's key from there)."""
    from rl.jobs.guard import POLICY_KEY_ENV
    from rl.jobs.policy import wait_healthy

    port = free_port()
    log = open(tmp_path_factory.mktemp("policy") / "policy.log", "wb")
    os.environ[POLICY_KEY_ENV] = POLICY_KEY
    proc = subprocess.Popen([sys.executable, "-m", "rl.jobs.policy", str(tiny_ckpt), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout_s=600, proc=proc, api_key=POLICY_KEY)
    except RuntimeError:
        proc.kill()
        raise
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
